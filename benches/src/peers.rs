//! `kvwire bench peers`: kvwire next to other transfer engines, in one run,
//! at the same sizes on the same host.
//!
//! - kvwire end to end: two real kvwired processes, a remapped and verified
//!   transfer (the soak's shape: TP2 NHD/16 → TP1 HND/32, shuffled tables),
//!   submit → `decoder_usable` seen, through `kvwire-soak` with one client,
//!   over tcp and over shm. The other engines' drivers time their writes of
//!   one buffer and check the bytes after; the soak does the same
//!   (`--check-every`): a new key written and every byte compared on the
//!   first transfer and then one in [`CHECK_EVERY`], the rest moving the
//!   same bytes again, so the client's own full rewrite and compare do not
//!   share the daemons' 2 cores on every timed transfer;
//! - kvwire's transport alone (one-sided writes over tcp and over shm, best of the run);
//! - Mooncake's TransferEngine (tcp, `transfer_sync_write`) and NIXL (UCX
//!   over tcp, and UCX's same-host path), each driven by `peers/peers.py`
//!   in a virtualenv under `target/` that `--install` creates. Each engine's
//!   bytes are checked where they landed.
//!
//! An engine that cannot be installed or run is skipped loudly, with why.
//! Ratios are an engine's p50 over kvwire's end-to-end p50 on the same
//! path: tcp engines against kvwire end to end over tcp, same-host ones
//! (NIXL's cma, kvwire's shm) against kvwire end to end over shm. Above 1
//! means kvwire was faster. Nothing here asserts a ratio.

use crate::{parse_size, Error};
use anyhow::{anyhow, bail, Context};
use clap::Args;
use kvwire_core::protocol::TransportKind;
use serde::Serialize;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The engines' driver, written out next to the virtualenv at run time.
const PEERS_PY: &str = include_str!("../peers/peers.py");

/// The soak's cache: 4 layers × 4 KV heads × 64 dims × (K, V) × fp16.
const SOAK_BYTES_PER_TOKEN: u64 = 4 * 4 * 64 * 2 * 2;

/// Arguments of `kvwire bench peers`.
#[derive(Debug, Args)]
pub struct PeersArgs {
    /// Transfer sizes, comma-separated (multiples of 4K).
    #[arg(long, default_value = "64K,1M,16M")]
    sizes: String,
    /// Seconds of kvwire end-to-end transfers per size.
    #[arg(long, default_value_t = 3)]
    seconds: u32,
    /// Timed writes per size for each other engine.
    #[arg(long, default_value_t = 50)]
    reps: u32,
    /// Create the engines' virtualenv (target/peers-venv) if it is missing.
    #[arg(long)]
    install: bool,
    /// Each side on CPUs of its own, as on two hosts: kvwire's source
    /// daemon and engine, and the other engines' initiating processes, on
    /// the first half of this process's CPUs; the destination daemon and
    /// the other engines' targets on the second.
    #[arg(long)]
    pin: bool,
    /// Directory for peers.jsonl.
    #[arg(long, default_value = "kvwire-campaign")]
    out: PathBuf,
}

/// One measured (engine, size) point: a line of peers.jsonl.
#[derive(Debug, Clone, Serialize)]
pub struct PeerPoint {
    /// `kvwire-e2e`, `kvwire-transport`, `kvwire-e2e-shm`, `kvwire-transport-shm`, `mooncake-tcp`, `nixl-tcp`, `nixl-cma`.
    pub engine: String,
    /// Bytes per transfer.
    pub size: u64,
    /// Median latency, µs (kvwire-transport: best of its run).
    pub p50_us: f64,
    /// 99th percentile, µs, where the engine's run gives one.
    pub p99_us: Option<f64>,
    /// `size / p50`, GB/s.
    pub gbps: f64,
    /// Every byte checked at the destination.
    pub verified: bool,
    /// This engine's p50 over kvwire end to end's on the same path (above 1: kvwire faster).
    pub ratio_to_kvwire: Option<f64>,
}

/// An engine left out, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The engine.
    pub engine: String,
    /// Why it did not run.
    pub reason: String,
}

/// Runs `kvwire bench peers`.
pub fn run(a: PeersArgs, out: &mut String) -> Result<(), Error> {
    let sizes = sizes(&a.sizes).map_err(Error::BadInput)?;
    if a.seconds < 3 || a.reps == 0 {
        return Err(Error::BadInput(anyhow!("--seconds must be at least 3 and --reps at least 1")));
    }
    let pinned = match a.pin {
        true => Some(crate::cpu_halves().map_err(|e| Error::BadInput(anyhow!("--pin: {e}")))?),
        false => None,
    };
    let mut points = Vec::new();
    for &size in &sizes {
        for kind in [TransportKind::Tcp, TransportKind::Shm] {
            eprintln!("kvwire: peers: kvwire end to end over {kind}, {size} bytes");
            points.push(kvwire_e2e(size, a.seconds, kind, pinned.is_some()).map_err(Error::Failed)?);
            let t = crate::baseline::transport(kind, size, a.reps.clamp(3, 50)).map_err(Error::Failed)?;
            let us = size as f64 / (t.gbps * 1e9) * 1e6;
            points.push(PeerPoint { engine: engine_name("kvwire-transport", kind), size, p50_us: us, p99_us: None, gbps: t.gbps, verified: true, ratio_to_kvwire: None });
        }
    }
    let mut skipped = Vec::new();
    match python(a.install) {
        Ok(py) => {
            for (engine, script_engine, tls) in [("mooncake-tcp", "mooncake", None), ("nixl-tcp", "nixl", Some("tcp")), ("nixl-cma", "nixl", None)] {
                eprintln!("kvwire: peers: {engine}");
                match engine_points(&py, engine, script_engine, tls, &sizes, a.reps, pinned.as_ref()) {
                    Ok(p) => points.extend(p),
                    Err(e) => skipped.push(Skipped { engine: engine.into(), reason: format!("{e:#}") }),
                }
            }
        }
        Err(e) => skipped.extend(["mooncake-tcp", "nixl-tcp", "nixl-cma"].map(|engine| Skipped { engine: engine.into(), reason: format!("{e:#}") })),
    }
    let e2e: Vec<(String, u64, f64)> = points.iter().filter(|p| p.engine.starts_with("kvwire-e2e")).map(|p| (p.engine.clone(), p.size, p.p50_us)).collect();
    for p in &mut points {
        let path = engine_name("kvwire-e2e", if same_host(&p.engine) { TransportKind::Shm } else { TransportKind::Tcp });
        p.ratio_to_kvwire = e2e.iter().find(|(e, s, _)| *e == path && *s == p.size).map(|(_, _, k)| p.p50_us / k);
    }
    write_jsonl(&a.out, &points, &skipped).map_err(Error::Failed)?;
    render(out, &sizes, &points, &skipped, pinned.as_ref());
    Ok(())
}

fn sizes(text: &str) -> anyhow::Result<Vec<u64>> {
    let mut v = Vec::new();
    for s in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let n = parse_size(s).map_err(|e| anyhow!("--sizes: {e}"))?;
        if n % SOAK_BYTES_PER_TOKEN != 0 || n / SOAK_BYTES_PER_TOKEN > 65536 {
            bail!("--sizes: {s} is not a multiple of 4K up to 256M (the end-to-end cache holds 4 KiB per token)");
        }
        v.push(n);
    }
    if v.is_empty() {
        bail!("--sizes: give at least one size");
    }
    Ok(v)
}

/// kvwire's row names: tcp's bare, shm's with `-shm`.
fn engine_name(base: &str, kind: TransportKind) -> String {
    match kind {
        TransportKind::Shm => format!("{base}-shm"),
        _ => base.to_string(),
    }
}

/// Whether an engine moves bytes through same-host memory (its ratio is
/// taken against kvwire end to end over shm).
fn same_host(engine: &str) -> bool {
    engine == "nixl-cma" || engine.ends_with("-shm")
}

/// The soak checks its first transfer and then one in this many, as the
/// other engines' drivers check after their timed writes.
const CHECK_EVERY: u32 = 64;

/// kvwire end to end at `size` over `kind`: `kvwire-soak` with one client.
fn kvwire_e2e(size: u64, seconds: u32, kind: TransportKind, pin: bool) -> anyhow::Result<PeerPoint> {
    let soak = kvwire_testkit::find_bin("kvwire-soak").map_err(|e| anyhow!(e))?;
    let tokens = size / SOAK_BYTES_PER_TOKEN;
    let mut c = Command::new(&soak);
    c.args(["--seconds", &seconds.to_string(), "--clients", "1", "--tokens", &tokens.to_string(), "--transport", kind.as_str(), "--check-every", &CHECK_EVERY.to_string(), "--json"]);
    if pin {
        c.arg("--pin");
    }
    let o = c
        .output()
        .with_context(|| format!("run {}", soak.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).with_context(|| format!("kvwire-soak output: {}", String::from_utf8_lossy(&o.stderr)))?;
    let ok = o.status.success() && v["errors"] == 0 && v["mismatches"] == 0 && v["checked"].as_u64().is_some_and(|c| c > 0);
    if !ok {
        bail!("kvwire-soak over {kind} at {tokens} tokens failed: {}", v["judgement"]);
    }
    let p50 = v["latency_ms"]["p50"].as_f64().ok_or_else(|| anyhow!("kvwire-soak gave no p50"))? * 1e3;
    let p99 = v["latency_ms"]["p99"].as_f64().map(|ms| ms * 1e3);
    Ok(PeerPoint { engine: engine_name("kvwire-e2e", kind), size, p50_us: p50, p99_us: p99, gbps: size as f64 / (p50 * 1e-6) / 1e9, verified: true, ratio_to_kvwire: None })
}

/// The virtualenv's python, made with `--install` when missing.
fn python(install: bool) -> anyhow::Result<PathBuf> {
    let venv = venv_dir()?;
    let py = venv.join("bin/python");
    if py.exists() {
        return Ok(py);
    }
    let cmd = format!("kvwire bench peers --install (makes {})", venv.display());
    if !install {
        bail!("no engines' virtualenv at {}: run {cmd}", venv.display());
    }
    let status = |c: &mut Command, what: &str| -> anyhow::Result<()> {
        let o = c.output().with_context(|| what.to_string())?;
        if !o.status.success() {
            bail!("{what} failed: {}", String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or_default());
        }
        Ok(())
    };
    status(Command::new("python3").arg("-m").arg("venv").arg(&venv), "python3 -m venv")?;
    let pip = venv.join("bin/pip");
    status(Command::new(&pip).args(["install", "-q", "numpy", "mooncake-transfer-engine-non-cuda==0.3.13.post1"]), "pip install numpy mooncake-transfer-engine-non-cuda")?;
    status(Command::new(&pip).args(["install", "-q", "--no-deps", "nixl==1.5.1", "nixl-cu12==1.5.1"]), "pip install nixl")?;
    Ok(py)
}

/// target/peers-venv, beside the directory of the running binary (target/<profile>).
fn venv_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("current exe")?;
    let profile = exe.parent().ok_or_else(|| anyhow!("the executable has no directory"))?;
    let target = profile.parent().ok_or_else(|| anyhow!("{} has no parent", profile.display()))?;
    Ok(target.join("peers-venv"))
}

/// One engine at every size, through `peers.py`.
fn engine_points(py: &Path, engine: &str, script_engine: &str, tls: Option<&str>, sizes: &[u64], reps: u32, pinned: Option<&(Vec<usize>, Vec<usize>)>) -> anyhow::Result<Vec<PeerPoint>> {
    let script = py.parent().and_then(Path::parent).ok_or_else(|| anyhow!("no venv directory"))?.join("peers.py");
    std::fs::write(&script, PEERS_PY).with_context(|| format!("write {}", script.display()))?;
    let sizes_arg = sizes.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let mut c = Command::new(py);
    c.arg(&script).args(["--engine", script_engine, "--sizes", &sizes_arg, "--reps", &reps.to_string()]);
    if let Some((src, dst)) = pinned {
        c.args(["--src-cpus", &crate::cpu_list(src), "--dst-cpus", &crate::cpu_list(dst)]);
    }
    // Without InfiniBand modules: a host's stray libefa crashes UCX at exit.
    c.env("UCX_MODULES", "^ib");
    if let Some(t) = tls {
        c.env("UCX_TLS", t);
    }
    let o = c.output().with_context(|| format!("run {}", script.display()))?;
    let mut points = Vec::new();
    for line in String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{engine} output line {line}"))?;
        let (size, p50) = (v["size"].as_u64().unwrap_or(0), v["p50_us"].as_f64().unwrap_or(0.0));
        points.push(PeerPoint {
            engine: engine.into(),
            size,
            p50_us: p50,
            p99_us: v["p99_us"].as_f64(),
            gbps: v["gbps_p50"].as_f64().unwrap_or(0.0),
            verified: v["verified"] == true,
            ratio_to_kvwire: None,
        });
    }
    if points.len() != sizes.len() {
        let err = String::from_utf8_lossy(&o.stderr);
        let tail: Vec<&str> = err.lines().filter(|l| !l.contains(" INFO ")).collect();
        bail!("{engine} measured {} of {} sizes: {}", points.len(), sizes.len(), tail.iter().rev().take(3).rev().cloned().collect::<Vec<_>>().join(" | "));
    }
    if let Some(p) = points.iter().find(|p| !p.verified) {
        bail!("{engine}: the bytes at {} did not match what was written", p.size);
    }
    Ok(points)
}

fn write_jsonl(dir: &Path, points: &[PeerPoint], skipped: &[Skipped]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("--out {}", dir.display()))?;
    let path = dir.join("peers.jsonl");
    let mut f = std::fs::File::create(&path).with_context(|| format!("write {}", path.display()))?;
    for p in points {
        writeln!(f, "{}", serde_json::json!({"kind": "peer_point", "point": p}))?;
    }
    for s in skipped {
        writeln!(f, "{}", serde_json::json!({"kind": "skipped", "skipped": s}))?;
    }
    Ok(())
}

fn render(out: &mut String, sizes: &[u64], points: &[PeerPoint], skipped: &[Skipped], pinned: Option<&(Vec<usize>, Vec<usize>)>) {
    let _ = writeln!(out, "kvwire bench peers: p50 µs per transfer, same host, same run; ratio = engine p50 / kvwire end-to-end p50 on the same path (tcp; same-host: -shm, nixl-cma), above 1: kvwire faster");
    let _ = writeln!(out, "{}", crate::host_conditions());
    if let Some((src, dst)) = pinned {
        let _ = writeln!(out, "pinned as on two hosts: sending side on CPUs {}, receiving side on CPUs {} (kvwire's daemons, the other engines' processes; kvwire-transport's endpoints share one process, unpinned)", crate::cpu_list(src), crate::cpu_list(dst));
    }
    let _ = writeln!(out, "{:<20} {:>10} {:>10} {:>10} {:>8}  verified", "engine", "size", "p50 µs", "p99 µs", "ratio");
    for &size in sizes {
        for p in points.iter().filter(|p| p.size == size) {
            let p99 = p.p99_us.map_or("-".to_string(), |v| format!("{v:.1}"));
            let ratio = p.ratio_to_kvwire.map_or("-".to_string(), |r| format!("{r:.2}"));
            let _ = writeln!(out, "{:<20} {:>10} {:>10.1} {:>10} {:>8}  {}", p.engine, size, p.p50_us, p99, ratio, if p.verified { "yes" } else { "NO" });
        }
    }
    for s in skipped {
        let _ = writeln!(out, "SKIPPED {}: {}", s.engine, s.reason);
    }
}
