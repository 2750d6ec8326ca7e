//! `kvwire bench layouts`: the campaign's layout dimension. Real models'
//! caches at several token counts move between two layouts through two
//! daemons (this process runs both, over real sockets and the chosen
//! transport), timed from submit until `decoder_usable` is seen, next to
//! the same payload's baseline in the same run: a raw socket for tcp, a
//! memcpy between two mappings for shm (what same-host shared memory is
//! up against), `ib_write_bw` on the device the daemons use for verbs.

use kvwire_core::protocol::TransportKind;
use crate::Error;
use kvwire_client::control::*;
use kvwire_client::Client;
use kvwire_testkit::{try_start_daemon_in, DaemonProc, TempDir};
use std::io::Read as _;
use anyhow::{anyhow, bail, Context};
use clap::Args;
use kvwire_core::layout::{self, ModelSpec};
use kvwire_core::plan::Side;
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::shard::LayoutSpec;
use kvwire_core::timing::{predict, Stage};
use kvwire_core::CacheFormat;
use kvwire_transport::HostMem;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Arguments of `kvwire bench layouts`.
#[derive(Debug, Args)]
pub struct LayoutsArgs {
    /// Built-in model.
    #[arg(long, default_value = "llama-3.1-8b")]
    model: String,
    /// Cache format.
    #[arg(long, default_value = "bf16")]
    format: String,
    /// Token counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,2048")]
    tokens: Vec<u64>,
    /// Layout pairs `SRC>DST`, separated by `;`.
    #[arg(long, default_value = "tp=1>tp=1;tp=8>tp=2;tp=8,block=16>tp=2,layout=hnd,block=32")]
    pairs: String,
    /// tcp, shm or verbs.
    #[arg(long, default_value = "tcp")]
    transport: TransportKind,
    /// Timed transfers per point.
    #[arg(long, default_value_t = 3)]
    iterations: u32,
    /// Directory for layouts.jsonl.
    #[arg(long, default_value = "kvwire-campaign")]
    out: PathBuf,
    /// Print the JSONL lines instead of a table.
    #[arg(long)]
    json: bool,
    /// Both daemons with `verify_checksums = false`: what the checksums cost.
    #[arg(long)]
    no_verify: bool,
    /// Also print each point's best transfer's timeline: every lifetime
    /// mark on both daemons (each layer's), ms from that daemon's enqueue.
    #[arg(long)]
    marks: bool,
}

/// One measured layout point (a line of layouts.jsonl).
#[derive(Debug, Clone, Serialize)]
pub struct LayoutPoint {
    /// Always `layout_point`.
    pub kind: &'static str,
    /// Model name.
    pub model: String,
    /// Cache format id.
    pub format: String,
    /// Tokens in the request.
    pub tokens: u64,
    /// Source layout.
    pub src_layout: String,
    /// Destination layout.
    pub dst_layout: String,
    /// Transport.
    pub transport: String,
    /// Timed transfers.
    pub iterations: u32,
    /// Whether the daemons checksummed each transfer.
    pub verify_checksums: bool,
    /// Payload bytes per transfer (plan total).
    pub payload_bytes: u64,
    /// Bytes written on the data plane per transfer.
    pub wire_bytes: u64,
    /// Plan segments.
    pub segments: u64,
    /// Best submit → decoder_usable, ns.
    pub best_ns: u64,
    /// Median, ns.
    pub p50_ns: u64,
    /// Payload GB/s at the best time.
    pub gbps: f64,
    /// What the baseline is: `socket` (tcp) or `memcpy` (shm).
    pub baseline: &'static str,
    /// The baseline moving the payload, GB/s (same run).
    pub baseline_gbps: f64,
    /// gbps / baseline_gbps.
    pub ratio: f64,
    /// The stage with the largest busy time in the best transfer.
    pub bounding: Option<String>,
    /// The best transfer's busy time per hop and side, as both daemons'
    /// status reported it.
    pub hops: Vec<PointHop>,
    /// The best transfer's lifetime marks per side, as both daemons'
    /// status reported them.
    pub marks: Vec<PointMark>,
}

/// One lifetime mark of one side in a point's best transfer.
#[derive(Debug, Clone, Serialize)]
pub struct PointMark {
    /// `source` or `destination`.
    pub side: &'static str,
    /// The boundary, e.g. `layer_ready(3)`.
    pub mark: String,
    /// From that daemon's enqueue of the transfer.
    pub at_ns: u64,
}

/// One hop of one side in a point's best transfer.
#[derive(Debug, Clone, Serialize)]
pub struct PointHop {
    /// Hop and side, e.g. `pack (source)`.
    pub hop: String,
    /// Busy nanoseconds.
    pub ns: u64,
    /// Bytes it handled.
    pub bytes: u64,
}

fn bad(flag: &str, why: impl std::fmt::Display) -> Error {
    Error::BadInput(anyhow!("--{flag}: {why}"))
}

fn identity(format: &CacheFormat) -> CacheIdentity {
    CacheIdentity {
        model_digest: "bench".into(),
        adapter_digest: String::new(),
        format: format.id(),
        tenant: "bench".into(),
        rope: "theta=10000".into(),
        position_offset: 0,
    }
}

/// Two kvwired processes on loopback, `bench-a` (source) peered with
/// `bench-b`; both killed, and their directory removed, on drop.
struct Pair {
    a: DaemonProc,
    b: DaemonProc,
    _dir: TempDir,
}

fn daemons(transport: TransportKind, verify: bool) -> anyhow::Result<Pair> {
    let dir = TempDir::try_new("layouts").map_err(|e| anyhow!(e))?;
    let secret = random_secret()?;
    let extra = format!("verify_checksums = {verify}\n[transport]\nkind = \"{transport}\"\n");
    let start = |node: &str, peers: &[(&str, &str)]| {
        try_start_daemon_in(None, "127.0.0.1", dir.path(), node, &secret, peers, &extra).map_err(|e| anyhow!(e))
    };
    let b = start("bench-b", &[])?;
    let a = start("bench-a", &[("bench-b", &b.peer)])?;
    Ok(Pair { a, b, _dir: dir })
}

/// A fresh cluster secret for the bench's own pair of daemons.
fn random_secret() -> anyhow::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).context("read /dev/urandom")?;
    Ok(b.iter().map(|b| format!("{b:02x}")).collect())
}

fn register(c: &Client, group: &str, model: &str, format: &CacheFormat, layout: &str, side: &Side, m: &ModelSpec) -> anyhow::Result<Vec<HostMem>> {
    let mut mems = Vec::new();
    for rank in 0..side.shard.ranks.len() as u32 {
        let len: u64 = side.regions(m, rank).iter().map(|(_, l)| l).sum();
        let mem = HostMem::new("kvwire-bench-rank", len)?;
        c.register(
            RegisterCache {
                group: group.into(),
                model: ModelSource::Builtin(model.into()),
                format: format.id(),
                layout: layout.into(),
                rank,
                num_blocks: side.num_blocks,
                identity: identity(format),
            },
            &mem,
        )?;
        mems.push(mem);
    }
    Ok(mems)
}

/// Runs the sweep.
pub fn run(a: LayoutsArgs, out: &mut String) -> Result<(), Error> {
    let model = layout::builtin(&a.model).map_err(|e| bad("model", e))?;
    let format = CacheFormat::parse(&a.format).map_err(|e| bad("format", e))?;
    let kind = a.transport;
    if a.iterations == 0 {
        return Err(bad("iterations", "must be > 0"));
    }
    if a.tokens.is_empty() || a.tokens.contains(&0) {
        return Err(bad("tokens", "token counts must be > 0"));
    }
    let mut pairs = Vec::new();
    for p in a.pairs.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (s, d) = p.split_once('>').ok_or_else(|| bad("pairs", format!("`{p}` is not SRC>DST")))?;
        LayoutSpec::parse(s).map_err(|e| bad("pairs", e))?;
        LayoutSpec::parse(d).map_err(|e| bad("pairs", e))?;
        pairs.push((s.to_string(), d.to_string()));
    }
    let points = sweep(&a, &model, &format, kind, &pairs).map_err(Error::Failed)?;
    std::fs::create_dir_all(&a.out).map_err(|e| Error::Failed(anyhow!("--out {}: {e}", a.out.display())))?;
    let jsonl: String = points.iter().map(|p| serde_json::to_string(p).expect("points serialize") + "\n").collect();
    let path = a.out.join("layouts.jsonl");
    std::fs::write(&path, &jsonl).map_err(|e| Error::Failed(anyhow!("{}: {e}", path.display())))?;
    if a.json {
        out.push_str(&jsonl);
        return Ok(());
    }
    let _ = writeln!(
        out,
        "kvwire bench layouts: {} {} over {}{}, {} timed transfers per point; latency = submit -> decoder_usable seen; base = {} of the payload, same run",
        a.model,
        format.id(),
        a.transport,
        if a.no_verify { " without checksums" } else { "" },
        a.iterations,
        baseline_of(a.transport).0
    );
    let _ = writeln!(out, "{}", crate::host_conditions());
    let _ = writeln!(
        out,
        "{:>7} {:<34} {:<34} {:>12} {:>9} {:>10} {:>10} {:>8} {:>9} {:>6}  bounding",
        "tokens", "src", "dst", "payload B", "segments", "best ms", "p50 ms", "GB/s", "base GB/s", "ratio"
    );
    for p in &points {
        let _ = writeln!(
            out,
            "{:>7} {:<34} {:<34} {:>12} {:>9} {:>10.3} {:>10.3} {:>8.3} {:>9.3} {:>6.3}  {}",
            p.tokens,
            p.src_layout,
            p.dst_layout,
            p.payload_bytes,
            p.segments,
            p.best_ns as f64 / 1e6,
            p.p50_ns as f64 / 1e6,
            p.gbps,
            p.baseline_gbps,
            p.ratio,
            p.bounding.as_deref().unwrap_or("-")
        );
        // Where the best transfer's time went, per hop and side, so a
        // reader sees the bottleneck without running anything else.
        let hops: Vec<String> = p.hops.iter().map(|h| format!("{} {:.3}", h.hop, h.ns as f64 / 1e6)).collect();
        let _ = writeln!(out, "{:>7} busy ms: {}", "", hops.join(", "));
        if a.marks {
            for side in ["source", "destination"] {
                let marks: Vec<String> = p.marks.iter().filter(|m| m.side == side).map(|m| format!("{} {:.3}", m.mark, m.at_ns as f64 / 1e6)).collect();
                let _ = writeln!(out, "{:>7} marks ({side}) ms: {}", "", marks.join(", "));
            }
        }
    }
    let _ = writeln!(out, "wrote {}", path.display());
    Ok(())
}

fn sweep(a: &LayoutsArgs, model: &ModelSpec, format: &CacheFormat, kind: TransportKind, pairs: &[(String, String)]) -> anyhow::Result<Vec<LayoutPoint>> {
    let d = daemons(kind, !a.no_verify).context("starting two daemons")?;
    let ca = Client::connect(&d.a.socket, "bench-prefill")?;
    let cb = Client::connect(&d.b.socket, "bench-decode")?;
    let mut points = Vec::new();
    for (pi, (src_l, dst_l)) in pairs.iter().enumerate() {
        for &tokens in &a.tokens {
            eprintln!("kvwire: layouts point: {tokens} tokens, {src_l} -> {dst_l}");
            let src = Side::new(model, &LayoutSpec::parse(src_l)?, *format, tokens)?;
            let dst = Side::new(model, &LayoutSpec::parse(dst_l)?, *format, tokens)?;
            let (sg, dg) = (format!("s{pi}-{tokens}"), format!("d{pi}-{tokens}"));
            let _src_mems = register(&ca, &sg, &a.model, format, src_l, &src, model)?;
            let _dst_mems = register(&cb, &dg, &a.model, format, dst_l, &dst, model)?;
            let mut times = Vec::new();
            let mut best: Option<(u64, TransferStatus, TransferStatus)> = None;
            for it in 0..=a.iterations {
                let req = format!("r{pi}-{tokens}-{it}");
                let slot = cb.prepare(PrepareReceive { group: dg.clone(), request: req.clone(), block_table: dst.block_table.clone(), tokens, prefix_tokens: 0, source: Some("bench-a".into()) })?;
                let t = Instant::now();
                let sslot = ca.submit(Submit {
                    request: req.clone(),
                    group: sg.clone(),
                    block_table: src.block_table.clone(),
                    tokens,
                    peer: "bench-b".into(),
                    dst_group: dg.clone(),
                    dst_request: req,
                    codec: None,
                    stream: false,
                })?
                .slot;
                cb.wait(slot, FlagName::DecoderUsable, Duration::from_secs(300))?;
                let ns = t.elapsed().as_nanos() as u64;
                ca.wait(sslot, FlagName::SourceReleased, Duration::from_secs(300))?;
                // The source's status is final once the destination's verdict is back.
                ca.wait(sslot, FlagName::DecoderUsable, Duration::from_secs(300))?;
                if it == 0 {
                    continue; // warm-up
                }
                times.push(ns);
                if best.as_ref().is_none_or(|b| ns < b.0) {
                    best = Some((ns, ca.status(sslot)?, cb.status(slot)?));
                }
            }
            let (best_ns, s, dstat) = best.ok_or_else(|| anyhow!("no timed transfer"))?;
            times.sort_unstable();
            let stages: Vec<Stage> = [("source", &s), ("destination", &dstat)]
                .iter()
                .flat_map(|(side, st)| {
                    st.hops.iter().filter(|h| h.hop != "post").map(move |h| Stage { hop: format!("{} ({side})", h.hop), total_ns: h.ns, bytes: h.bytes })
                })
                .collect();
            let bounding = predict(&stages, model.layers.len() as u64, 0).bounding;
            let hops = stages.iter().map(|st| PointHop { hop: st.hop.clone(), ns: st.total_ns, bytes: st.bytes }).collect();
            let marks = [("source", &s), ("destination", &dstat)]
                .into_iter()
                .flat_map(|(side, st)| st.marks.iter().map(move |m| PointMark { side, mark: m.name.clone(), at_ns: m.at_ns }))
                .collect();
            let payload = s.bytes;
            let (baseline, measure) = baseline_of(a.transport);
            let base = measure(payload.max(1), a.iterations)?;
            let base_ns = base.iter().min().map_or(1, |d| d.as_nanos() as u64).max(1);
            let gbps = payload as f64 / best_ns as f64;
            let baseline_gbps = payload as f64 / base_ns as f64;
            // Every rank of both groups goes, so the next point's memory
            // does not add to this one's (limits.max_memory_bytes).
            for rank in 0..src.shard.ranks.len() as u32 {
                ca.release(&sg, rank).ok();
            }
            for rank in 0..dst.shard.ranks.len() as u32 {
                cb.release(&dg, rank).ok();
            }
            points.push(LayoutPoint {
                kind: "layout_point",
                model: a.model.clone(),
                format: format.id(),
                tokens,
                src_layout: src_l.clone(),
                dst_layout: dst_l.clone(),
                transport: a.transport.as_str().into(),
                iterations: a.iterations,
                verify_checksums: !a.no_verify,
                payload_bytes: payload,
                wire_bytes: s.wire_bytes,
                segments: s.segments,
                best_ns,
                p50_ns: times[times.len() / 2],
                gbps,
                baseline,
                baseline_gbps,
                ratio: gbps / baseline_gbps,
                bounding,
                hops,
                marks,
            });
        }
    }
    if points.is_empty() {
        bail!("no layout pairs given");
    }
    Ok(points)
}

/// The baseline a transport is held against, and its measurement: a raw
/// loopback socket for tcp, a single-thread memcpy for shm, one
/// `ib_write_bw` stream for verbs.
type Measure = fn(u64, u32) -> anyhow::Result<Vec<std::time::Duration>>;
fn baseline_of(t: TransportKind) -> (&'static str, Measure) {
    match t {
        TransportKind::Shm => ("memcpy", crate::baseline::memcpy_baseline),
        TransportKind::Verbs => ("ib_write_bw", ib_write_bw_once),
        TransportKind::Tcp => ("socket", crate::baseline::tcp_baseline),
    }
}

/// One transfer's time at `ib_write_bw`'s bandwidth for `size` bytes.
fn ib_write_bw_once(size: u64, iters: u32) -> anyhow::Result<Vec<std::time::Duration>> {
    let gbps = crate::baseline::ib_write_bw_aggregate(size, iters, 1)?;
    Ok(vec![std::time::Duration::from_secs_f64(size as f64 / (gbps * 1e9))])
}
