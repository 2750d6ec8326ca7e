//! The `kvwire` command line: raw arguments (clap) → validated settings → run → render.
//! It owns [`Failure`] and the exit codes; the benches and reports come from
//! kvwire-bench, the stats from kvwire-client, and none of it links the daemon.

#![warn(missing_docs)]

mod topology;

use kvwire_bench::parse_size;
use kvwire_client::promtext;
use anyhow::{anyhow, Context};
use clap::{Args, Parser, Subcommand};
use kvwire_core::layout::{self, Inventory};
use kvwire_core::plan::{self, CostModel, Plan, PlanInput, Side};
use kvwire_core::protocol::TransportKind;
use kvwire_core::shard::LayoutSpec;
use kvwire_core::{verify, CacheFormat, Geometry, ModelSpec};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;


/// kvwire: move KV caches between inference servers, and account for every byte.
#[derive(Debug, Parser)]
#[command(name = "kvwire", version)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Count a model's KV cache for a request: payload and allocated bytes, per layer kind.
    Inventory(InventoryArgs),
    /// Plan a transfer between two parallel layouts and report its counters.
    Plan(PlanArgs),
    /// List the built-in models.
    Models,
    /// List the cache formats.
    Formats,
    /// Benchmarks that print a ratio against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// A running kvwired's counters and per-hop table, from its metrics
    /// endpoint (`--metrics`) or its control socket (`--socket`).
    Stats(StatsArgs),
    /// The roofline: attainable rate min(P, I × B), and which roof binds.
    Roofline(kvwire_bench::report::RooflineArgs),
    /// One self-contained HTML page from a campaign: table, plots and the ceiling lab.
    Report(kvwire_bench::report::ReportArgs),
    /// This host's RDMA devices, netdevs and GPUs (NUMA node, PCI path), and
    /// for each GPU and NUMA node the rails in preference order.
    Topology(crate::topology::TopologyArgs),
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("daemon").required(true).args(["metrics", "socket"])))]
struct StatsArgs {
    /// The daemon's `metrics_listen` address: GET http://HOST:PORT/metrics.
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<String>,
    /// The daemon's `control_socket`: ask over the control API.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// One-sided write throughput of a transport against its baseline.
    Transport(BenchTransportArgs),
    /// A sweep over transports, sizes and concurrency: table, JSONL and SVG plots.
    Campaign(kvwire_bench::campaign::CampaignArgs),
    /// A sweep over real models' token counts and layout pairs, through two daemons.
    Layouts(kvwire_bench::layouts::LayoutsArgs),
    /// kvwire end to end and its transport beside Mooncake and NIXL, same sizes, same run.
    Peers(kvwire_bench::peers::PeersArgs),
}

#[derive(Debug, Args)]
struct BenchTransportArgs {
    /// tcp, shm or verbs.
    #[arg(long)]
    transport: kvwire_core::protocol::TransportKind,
    /// Bytes per transfer (suffixes K, M, G = KiB, MiB, GiB).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    size: u64,
    /// Timed transfers after one warm-up.
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct ModelArgs {
    /// Built-in model name, a Hugging Face config.json, or a TOML spec.
    #[arg(long)]
    model: String,
    /// Tokens in the request.
    #[arg(long)]
    tokens: u64,
    /// Cache format (default: the config's dtype).
    #[arg(long)]
    format: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct InventoryArgs {
    #[command(flatten)]
    common: ModelArgs,
    /// Tokens per block (page).
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Pad every row to a multiple of this many bytes.
    #[arg(long, default_value_t = 1)]
    row_align: u32,
    /// Pad every block to a multiple of this many bytes.
    #[arg(long, default_value_t = 1)]
    block_align: u32,
}

#[derive(Debug, Args)]
struct PlanArgs {
    #[command(flatten)]
    common: ModelArgs,
    /// Source layout: tp=8[,pp=2][,pp_layers=…][,block=16][,layout=nhd|hnd][,table=contig|shuffle[:SEED]][,kv=vllm_nhd|vllm_hnd|flashinfer|flashinfer_hnd|vllm_cpu|vllm_cross|ORDER[,pad=b256:t64]] (kv= engine tensors; pad= elements of padding after each step of an axis).
    #[arg(long)]
    src: String,
    /// Destination layout, same keys as --src.
    #[arg(long)]
    dst: String,
    /// Explicit source shard map (TOML `[[rank]]` entries); overrides tp/pp of --src.
    #[arg(long)]
    src_map: Option<String>,
    /// Explicit destination shard map; overrides tp/pp of --dst.
    #[arg(long)]
    dst_map: Option<String>,
    /// Leading positions the destination already holds (same model, format, tenant, positions).
    #[arg(long, default_value_t = 0)]
    prefix_tokens: u64,
    /// The data plane the plan is for (tcp, shm or verbs): its cost per write decides which strided segments go packed.
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// Execute the plan on synthetic buffers and check every destination byte.
    #[arg(long)]
    verify: bool,
    /// Buffer limit for --verify, in MiB.
    #[arg(long, default_value_t = 4096)]
    verify_limit_mib: u64,
}

/// A failure, with the exit status it maps to.
#[derive(Debug)]
pub enum Failure {
    /// Bad input: exit 2.
    BadInput(anyhow::Error),
    /// The check that was asked for failed: exit 1.
    Failed(anyhow::Error),
}

impl Failure {
    /// Prints the error chain and returns the exit status.
    pub fn report(self) -> ExitCode {
        let (err, code) = match self {
            Failure::BadInput(e) => (e, 2),
            Failure::Failed(e) => (e, 1),
        };
        eprintln!("kvwire: error: {err:#}");
        ExitCode::from(code)
    }
}

impl From<kvwire_bench::Error> for Failure {
    fn from(e: kvwire_bench::Error) -> Failure {
        match e {
            kvwire_bench::Error::BadInput(e) => Failure::BadInput(e),
            kvwire_bench::Error::Failed(e) => Failure::Failed(e),
        }
    }
}

fn bad<E: Into<anyhow::Error>>(e: E) -> Failure {
    Failure::BadInput(e.into())
}

/// Loads a model from a built-in name, a `.json` HF config or a `.toml` spec.
pub fn load_model(arg: &str) -> anyhow::Result<ModelSpec> {
    let path = Path::new(arg);
    let is_path = arg.ends_with(".json") || arg.ends_with(".toml") || arg.contains('/');
    if !is_path {
        return Ok(layout::builtin(arg)?);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read model file {}", path.display()))?;
    let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or(arg);
    let spec = if arg.ends_with(".toml") {
        layout::from_toml_spec(name, &text)
    } else {
        layout::from_hf_config(name, &text)
    };
    spec.with_context(|| format!("model {}", path.display()))
}

/// The format asked for, or the model's dtype.
fn resolve_format(model: &ModelSpec, format: Option<&str>) -> anyhow::Result<CacheFormat> {
    match format {
        Some(f) => Ok(CacheFormat::parse(f).context("--format")?),
        None => {
            let dtype = model
                .dtype
                .as_deref()
                .ok_or_else(|| anyhow!("model {} declares no torch_dtype/dtype; pass --format", model.name))?;
            Ok(CacheFormat::parse(dtype).with_context(|| format!("model {}'s dtype", model.name))?)
        }
    }
}

/// Runs the parsed command line, writing its output to `out`.
pub fn run(cli: Cli, out: &mut String) -> Result<(), Failure> {
    match cli.command {
        Command::Inventory(a) => inventory(a, out),
        Command::Plan(a) => plan_cmd(a, out),
        Command::Models => {
            for (name, _) in layout::BUILTINS {
                let m = layout::builtin(name).map_err(|e| Failure::Failed(e.into()))?;
                let _ = writeln!(out, "{name:<18} {:<12} {} layers, dtype {}", m.family, m.layers.len(), m.dtype.as_deref().unwrap_or("-"));
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Transport(a)) => {
            let r = kvwire_bench::baseline::transport(a.transport, a.size, a.iterations).map_err(Failure::Failed)?;
            if a.json {
                out.push_str(&serde_json::to_string_pretty(&r).expect("bench result serializes"));
                out.push('\n');
            } else {
                let _ = writeln!(out, "transport {}  size {}  iterations {}", r.transport, bytes(r.size), r.iterations);
                let _ = writeln!(out, "{:<34} {:>10}", "path", "GB/s");
                let _ = writeln!(out, "{:<34} {:>10.3}", format!("kvwire {} one-sided write", r.transport), r.gbps);
                let _ = writeln!(out, "{:<34} {:>10.3}", r.baseline, r.baseline_gbps);
                let _ = writeln!(out, "ratio {:.3}", r.ratio);
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Campaign(a)) => kvwire_bench::campaign::run(a, out).map_err(Failure::from),
        Command::Bench(BenchCommand::Layouts(a)) => kvwire_bench::layouts::run(a, out).map_err(Failure::from),
        Command::Bench(BenchCommand::Peers(a)) => kvwire_bench::peers::run(a, out).map_err(Failure::from),
        Command::Stats(a) => stats(a, out),
        Command::Roofline(a) => kvwire_bench::report::roofline_cmd(a, out).map_err(Failure::from),
        Command::Report(a) => kvwire_bench::report::report_cmd(a, out).map_err(Failure::from),
        Command::Topology(a) => crate::topology::topology_cmd(a, out),
        Command::Formats => {
            for f in kvwire_core::format::FORMATS {
                let _ = writeln!(out, "{:<18} {}", f.id(), f.summary);
            }
            Ok(())
        }
    }
}

fn inventory(a: InventoryArgs, out: &mut String) -> Result<(), Failure> {
    let model = load_model(&a.common.model).map_err(bad)?;
    let format = resolve_format(&model, a.common.format.as_deref()).map_err(bad)?;
    let geo = Geometry { format, block_size: a.block_size, row_align: a.row_align, block_align: a.block_align }
        .validated()
        .map_err(bad)?;
    let inv = layout::inventory(&model, &geo, a.common.tokens).map_err(bad)?;
    if a.common.json {
        out.push_str(&serde_json::to_string_pretty(&inv).expect("inventory serializes"));
        out.push('\n');
    } else {
        render_inventory(&inv, out);
    }
    Ok(())
}

/// `1234567 (1.2 MiB)`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{n} ({v:.1} {})", UNITS[u])
    }
}

fn render_inventory(inv: &Inventory, out: &mut String) {
    let _ = writeln!(
        out,
        "model {}  format {}  tokens {}  block {}  row_align {}  block_align {}",
        inv.model, inv.format, inv.tokens, inv.block_size, inv.row_align, inv.block_align
    );
    let _ = writeln!(out, "{:<12} {:>6} {:>10} {:>16} {:>26} {:>26}", "kind", "layers", "retained", "bytes/token/layer", "payload_bytes", "allocated_bytes");
    for k in &inv.kinds {
        let _ = writeln!(
            out,
            "{:<12} {:>6} {:>10} {:>16} {:>26} {:>26}",
            k.kind,
            k.layers,
            k.retained_tokens,
            k.per_token_bytes,
            bytes(k.payload_bytes),
            bytes(k.allocated_bytes)
        );
    }
    let _ = writeln!(out, "{:<12} {:>6} {:>10} {:>16} {:>26} {:>26}", "total", inv.per_layer.len(), "", "", bytes(inv.payload_bytes), bytes(inv.allocated_bytes));
    match inv.per_token_bytes {
        Some(p) => {
            let _ = writeln!(out, "per_token_bytes {p}  fixed_bytes {}", inv.fixed_bytes);
        }
        None => {
            let _ = writeln!(out, "per_token_bytes not uniform (windowed layers retain fewer tokens)  fixed_bytes {}", inv.fixed_bytes);
        }
    }
    let _ = writeln!(out, "wire_bytes: set by the transfer layer (what crosses the link: payload after packing and codec, framing, answers, control)");
}

fn layout_arg(flag: &str, text: &str, map: Option<&str>) -> anyhow::Result<LayoutSpec> {
    let spec = LayoutSpec::parse(text).with_context(|| format!("--{flag}"))?;
    match map {
        Some(path) => {
            let toml = std::fs::read_to_string(path).with_context(|| format!("cannot read --{flag}-map {path}"))?;
            Ok(spec.with_explicit_toml(&toml).with_context(|| format!("--{flag}-map {path}"))?)
        }
        None => Ok(spec),
    }
}

/// Builds both sides and the plan from CLI-level inputs.
pub fn build_plan(
    model: &ModelSpec,
    tokens: u64,
    format: CacheFormat,
    src: &LayoutSpec,
    dst: &LayoutSpec,
    prefix_tokens: u64,
    transport: TransportKind,
) -> anyhow::Result<(Side, Side, Plan)> {
    let src = Side::new(model, src, format, tokens).context("source layout")?;
    let dst = Side::new(model, dst, format, tokens).context("destination layout")?;
    let input = PlanInput { model, tokens, prefix_tokens, src: &src, dst: &dst, cost: CostModel::for_transport(transport) };
    let plan = plan::build(&input)?;
    Ok((src, dst, plan))
}

fn plan_cmd(a: PlanArgs, out: &mut String) -> Result<(), Failure> {
    let model = load_model(&a.common.model).map_err(bad)?;
    let format = resolve_format(&model, a.common.format.as_deref()).map_err(bad)?;
    let src_spec = layout_arg("src", &a.src, a.src_map.as_deref()).map_err(bad)?;
    let dst_spec = layout_arg("dst", &a.dst, a.dst_map.as_deref()).map_err(bad)?;
    let transport: TransportKind = a.transport.parse().context("--transport").map_err(bad)?;
    let (src, dst, plan) =
        build_plan(&model, a.common.tokens, format, &src_spec, &dst_spec, a.prefix_tokens, transport).map_err(bad)?;
    let verified = if a.verify {
        let report = verify::verify(&model, &src, &dst, &plan, a.verify_limit_mib << 20).map_err(|e| match e {
            verify::VerifyError::TooLarge { .. } => bad(e),
            other => Failure::Failed(anyhow!(other).context("plan verification failed")),
        })?;
        Some(report)
    } else {
        None
    };
    let c = &plan.counters;
    let (shapes, groups) = plan.segments.stored();
    if a.common.json {
        let v = serde_json::json!({
            "model": model.name,
            "format": format.id(),
            "tokens": plan.tokens,
            "prefix_tokens": plan.prefix_tokens,
            "segments": c.segments,
            "writes": c.writes,
            "stored": {"template_shapes": shapes, "groups": groups},
            "total_bytes_moved": c.total_bytes_moved,
            "reused_bytes": c.reused_bytes,
            "packed_bytes": c.packed_bytes,
            "direct_bytes": c.direct_bytes,
            "metadata_bytes": c.metadata_bytes,
            "src_ranks": c.src_ranks.iter().map(|r| serde_json::json!({"rank": r.rank, "bytes_sent": r.bytes})).collect::<Vec<_>>(),
            "dst_ranks": c.dst_ranks.iter().map(|r| serde_json::json!({"rank": r.rank, "bytes_received": r.bytes})).collect::<Vec<_>>(),
            "cost_model": plan.cost,
            "verified": verified.as_ref().map(|r| serde_json::json!({
                "bytes_copied": r.bytes_copied, "bytes_expected": r.bytes_expected, "bytes_checked": r.bytes_checked,
            })),
        });
        out.push_str(&serde_json::to_string_pretty(&v).expect("plan serializes"));
        out.push('\n');
        return Ok(());
    }
    let _ = writeln!(out, "model {}  format {}  tokens {}  prefix {}", model.name, format.id(), plan.tokens, plan.prefix_tokens);
    let _ = writeln!(out, "src {}  ->  dst {}", a.src, a.dst);
    let _ = writeln!(out, "segments {}  writes {}  (stored as {shapes} template shapes stamped over {groups} groups)", c.segments, c.writes);
    let _ = writeln!(out, "total_bytes_moved {}", bytes(c.total_bytes_moved));
    let _ = writeln!(out, "  direct {}  packed {}", bytes(c.direct_bytes), bytes(c.packed_bytes));
    let _ = writeln!(out, "reused_bytes {}  metadata_bytes {}", bytes(c.reused_bytes), c.metadata_bytes);
    let _ = writeln!(out, "{:<10} {:>26}", "src rank", "bytes_sent");
    for r in &c.src_ranks {
        let _ = writeln!(out, "{:<10} {:>26}", r.rank, bytes(r.bytes));
    }
    let _ = writeln!(out, "{:<10} {:>26}", "dst rank", "bytes_received");
    for r in &c.dst_ranks {
        let _ = writeln!(out, "{:<10} {:>26}", r.rank, bytes(r.bytes));
    }
    if let Some(r) = verified {
        let _ = writeln!(
            out,
            "verify: ok — {} bytes copied, every one of {} destination bytes checked",
            r.bytes_copied, r.bytes_checked
        );
    }
    Ok(())
}

// ------------------------------------------------------------ stats

/// How long `kvwire stats` waits to connect, and then for the whole answer.
const STATS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn stats(a: StatsArgs, out: &mut String) -> Result<(), Failure> {
    let (source, text) = match (&a.metrics, &a.socket) {
        (Some(addr), _) => (format!("http://{addr}/metrics"), fetch_metrics(addr)?),
        (None, Some(path)) => {
            let c = kvwire_client::Client::connect(path, "kvwire-stats")
                .with_context(|| format!("cannot connect to kvwired's control socket {}", path.display()))
                .map_err(Failure::Failed)?;
            let text = c.stats().with_context(|| format!("stats from control socket {}", path.display())).map_err(Failure::Failed)?;
            (format!("unix:{}", path.display()), text)
        }
        (None, None) => return Err(bad(anyhow!("give --metrics HOST:PORT or --socket PATH"))),
    };
    let st = promtext::Stats::from_text(&text).with_context(|| format!("metrics from {source}")).map_err(Failure::Failed)?;
    if a.json {
        let mut v = serde_json::to_value(&st).expect("stats serialize");
        v.as_object_mut().expect("stats is an object").insert("source".into(), source.into());
        out.push_str(&serde_json::to_string_pretty(&v).expect("stats serialize"));
        out.push('\n');
    } else {
        render_stats(&source, &st, out);
    }
    Ok(())
}

/// GET /metrics from `addr` over plain HTTP/1.1; the body as text.
fn fetch_metrics(addr: &str) -> Result<String, Failure> {
    use std::io::{Read as _, Write as _};
    use std::net::{TcpStream, ToSocketAddrs as _};
    let port_ok = addr.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !port_ok {
        return Err(bad(anyhow!("--metrics `{addr}` is not HOST:PORT")));
    }
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve metrics address {addr}"))
        .map_err(Failure::Failed)?
        .collect();
    let mut last = None;
    let mut stream = None;
    for sa in &addrs {
        match TcpStream::connect_timeout(sa, STATS_TIMEOUT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut s = match (stream, last) {
        (Some(s), _) => s,
        (None, Some(e)) => return Err(Failure::Failed(anyhow!(e).context(format!("cannot connect to metrics endpoint {addr}")))),
        (None, None) => return Err(Failure::Failed(anyhow!("metrics address {addr} resolves to nothing"))),
    };
    let io = |e: std::io::Error| Failure::Failed(anyhow!(e).context(format!("metrics endpoint {addr}")));
    s.set_read_timeout(Some(STATS_TIMEOUT)).map_err(io)?;
    s.set_write_timeout(Some(STATS_TIMEOUT)).map_err(io)?;
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).map_err(io)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(io)?;
    http_body(&raw).with_context(|| format!("metrics endpoint {addr}")).map_err(Failure::Failed)
}

/// The body of a complete HTTP/1.x response, which must be `200`; honours
/// `Content-Length` and `Transfer-Encoding: chunked`.
pub fn http_body(raw: &[u8]) -> anyhow::Result<String> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| {
        if raw.is_empty() {
            anyhow!("closed the connection without an answer")
        } else {
            anyhow!("answer is not HTTP (no end of headers)")
        }
    })?;
    let head = std::str::from_utf8(&raw[..split]).context("HTTP headers are not UTF-8")?;
    let mut body = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or_default();
    let mut parts = status.splitn(3, ' ');
    let (proto, code) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    if !proto.starts_with("HTTP/1.") {
        return Err(anyhow!("answer is not HTTP/1.x: `{status}`"));
    }
    if code != "200" {
        return Err(anyhow!("answered `{status}`, not 200"));
    }
    let mut chunked = false;
    for h in lines {
        let Some((k, v)) = h.split_once(':') else { continue };
        let v = v.trim();
        if k.eq_ignore_ascii_case("content-length") {
            let n: usize = v.parse().with_context(|| format!("bad Content-Length `{v}`"))?;
            if body.len() < n {
                return Err(anyhow!("body cut short: {} of {n} bytes", body.len()));
            }
            body = &body[..n];
        } else if k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        }
    }
    let body = if chunked { dechunk(body)? } else { body.to_vec() };
    String::from_utf8(body).context("metrics body is not UTF-8")
}

fn dechunk(mut b: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").ok_or_else(|| anyhow!("chunked body cut short"))?;
        let size_text = std::str::from_utf8(&b[..eol]).unwrap_or("?");
        let size_hex = size_text.split(';').next().unwrap_or_default().trim();
        let n = usize::from_str_radix(size_hex, 16).map_err(|_| anyhow!("bad chunk size `{size_text}`"))?;
        b = &b[eol + 2..];
        if n == 0 {
            return Ok(out);
        }
        if b.len() < n + 2 {
            return Err(anyhow!("chunked body cut short"));
        }
        out.extend_from_slice(&b[..n]);
        b = &b[n + 2..];
    }
}

/// `0.000012` s → `12.0 µs`.
fn seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// Bytes per second, decimal units (as link speeds are quoted).
fn rate(bps: f64) -> String {
    const UNITS: [&str; 5] = ["B/s", "kB/s", "MB/s", "GB/s", "TB/s"];
    let (mut v, mut u) = (bps, 0);
    while v >= 1000.0 && u < UNITS.len() - 1 {
        v /= 1000.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

fn render_stats(source: &str, st: &promtext::Stats, out: &mut String) {
    let _ = writeln!(out, "node {}  from {source}", st.node.as_deref().unwrap_or("-"));
    let c = &st.counters;
    let _ = writeln!(out, "{:<44} {:>26}", "counter", "value");
    for (name, v) in [
        ("payload_bytes", c.payload_bytes),
        ("wire_bytes", c.wire_bytes),
        ("reused_bytes", c.reused_bytes),
        ("retransmitted_bytes", c.retransmitted_bytes),
        ("compressed_bytes", c.compressed_bytes),
        ("received_bytes", c.received_bytes),
    ] {
        let _ = writeln!(out, "{name:<44} {:>26}", bytes(v));
    }
    for t in &st.transfers {
        let _ = writeln!(out, "{:<44} {:>26}", format!("transfers role={} outcome={}", t.role, t.outcome), t.count);
    }
    for h in &st.starts {
        let _ = writeln!(out, "{:<44} {:>26}", format!("starts {}", h.how), h.count);
    }
    for c in &st.connections {
        let _ = writeln!(out, "{:<44} {:>26}", format!("connections {} {}", c.kind, c.how), c.count);
    }
    for r in &st.refused {
        let _ = writeln!(out, "{:<44} {:>26}", format!("refused {}", r.who), r.count);
    }
    // Only the reasons that happened: most never do.
    for r in st.writes_refused.iter().filter(|r| r.count > 0) {
        let _ = writeln!(out, "{:<44} {:>26}", format!("writes refused {}", r.who), r.count);
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<15} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>26} {:>12}",
        "hop", "count", "p50", "p90", "p99", "p99.9", "max", "mean", "from", "bytes", "bandwidth"
    );
    let opt = |v: Option<f64>| v.map(seconds).unwrap_or_else(|| "-".into());
    for h in &st.hops {
        let from = match h.latency_from {
            promtext::LatencyFrom::Histogram => "histogram",
            promtext::LatencyFrom::Buckets => "buckets",
            promtext::LatencyFrom::Mean => "mean",
        };
        let _ = writeln!(
            out,
            "{:<15} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>26} {:>12}",
            h.hop,
            h.count,
            opt(h.p50_seconds),
            opt(h.p90_seconds),
            opt(h.p99_seconds),
            opt(h.p999_seconds),
            opt(h.max_seconds),
            opt(h.mean_seconds),
            from,
            bytes(h.bytes),
            h.bandwidth_bytes_per_second.map(rate).unwrap_or_else(|| "-".into())
        );
    }
    if !st.device_memory.is_empty() {
        let _ = writeln!(out, "device memory at the source (direct: read in place by the NIC; staged: through a ring)");
        for d in &st.device_memory {
            let _ = writeln!(out, "  group {} rank {} memory {}: {} ({})", d.group, d.rank, d.memory, d.path, d.detail);
        }
    }
    let _ = writeln!(
        out,
        "quantiles: the daemon's hdrhistogram (within 0.1%) where `from` is histogram; p50/p99 estimated from buckets\n\
         (linear interpolation) where it is buckets; otherwise only mean = sum/count.\n\
         bandwidth: effective, bytes / total seconds spent in the hop."
    );
}
