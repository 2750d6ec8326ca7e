//! The ceiling lab: `kvwire roofline` and `kvwire report --html`.
//!
//! A pure core — [`roofline`], [`parse_campaign`], [`Point::roofs`] and
//! [`render_html`] take values and return values — with thin I/O around it
//! ([`roofline_cmd`], [`report_cmd`]) that reads files, runs the default
//! campaign and writes the page.
//!
//! The hop-ceiling view is an analogy with the roofline model, not a
//! transfer simulator: every roof is a measured per-hop bandwidth
//! (`bytes / sum_ns`), and the achieved rate is the campaign's `gbps_avg`.

use crate::campaign::{fit_label, model_error, Baseline, HopStat, LatNs};
use kvwire_core::timing::Prediction;
use crate::Error;
use anyhow::{anyhow, Context};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

// ------------------------------------------------------------ roofline

/// Raw arguments of `kvwire roofline`; numbers stay text until [`roofline_cmd`]
/// validates them, so a bad value is reported as bad input naming its flag.
#[derive(Debug, Args)]
pub struct RooflineArgs {
    /// Arithmetic intensity I, in FLOP per byte (> 0).
    #[arg(long, value_name = "I", allow_hyphen_values = true)]
    intensity: String,
    /// Bandwidth B, in GB/s (1e9 bytes/s, > 0).
    #[arg(long, value_name = "B", allow_hyphen_values = true)]
    bandwidth: String,
    /// Compute peak P, in GFLOP/s (> 0). Without it only the bandwidth roof applies.
    #[arg(long, value_name = "P", allow_hyphen_values = true)]
    peak: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Which roof sets the attainable rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Bound {
    /// `I × B < P` (or no peak given): the slanted bandwidth roof binds.
    #[serde(rename = "bandwidth-bound")]
    Bandwidth,
    /// `I × B ≥ P`: the flat compute roof binds.
    #[serde(rename = "compute-bound")]
    Compute,
}

impl Bound {
    /// `bandwidth-bound` or `compute-bound`.
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::Bandwidth => "bandwidth-bound",
            Bound::Compute => "compute-bound",
        }
    }
}

/// The roofline at one intensity: `attainable = min(P, I × B)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Roofline {
    /// I, FLOP/byte.
    pub intensity: f64,
    /// B, GB/s.
    pub bandwidth_gbps: f64,
    /// P, GFLOP/s; `None` when only the bandwidth roof applies.
    pub peak_gflops: Option<f64>,
    /// `I × B`, GFLOP/s.
    pub bandwidth_roof_gflops: f64,
    /// `min(P, I × B)`, GFLOP/s.
    pub attainable_gflops: f64,
    /// The roof that binds.
    pub bound: Bound,
    /// `P / B`: the intensity where the two roofs meet (FLOP/byte).
    pub ridge_intensity: Option<f64>,
}

/// Why a roofline input was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RooflineError {
    /// The text is not a number.
    #[error("{flag} `{value}` is not a number")]
    NotANumber {
        /// The flag, e.g. `--intensity`.
        flag: &'static str,
        /// What was given.
        value: String,
    },
    /// The number is zero, negative, infinite or NaN.
    #[error("{flag} must be a finite number > 0, got `{value}`")]
    NotPositive {
        /// The flag, e.g. `--bandwidth`.
        flag: &'static str,
        /// What was given.
        value: String,
    },
    /// `I × B` overflows.
    #[error("--intensity × --bandwidth overflows ({intensity} × {bandwidth})")]
    Overflow {
        /// I as given.
        intensity: String,
        /// B as given.
        bandwidth: String,
    },
}

/// Parses a flag's value as a finite number > 0.
pub fn positive(flag: &'static str, text: &str) -> Result<f64, RooflineError> {
    let v: f64 = text.trim().parse().map_err(|_| RooflineError::NotANumber { flag, value: text.into() })?;
    if !(v.is_finite() && v > 0.0) {
        return Err(RooflineError::NotPositive { flag, value: text.into() });
    }
    Ok(v)
}

/// `min(P, I × B)` and the roof that binds. Inputs must be finite and > 0
/// (see [`positive`]); an overflowing product is refused.
pub fn roofline(intensity: f64, bandwidth_gbps: f64, peak_gflops: Option<f64>) -> Result<Roofline, RooflineError> {
    let roof = intensity * bandwidth_gbps;
    if !roof.is_finite() {
        return Err(RooflineError::Overflow { intensity: intensity.to_string(), bandwidth: bandwidth_gbps.to_string() });
    }
    let (attainable, bound) = match peak_gflops {
        Some(p) if p <= roof => (p, Bound::Compute),
        _ => (roof, Bound::Bandwidth),
    };
    Ok(Roofline {
        intensity,
        bandwidth_gbps,
        peak_gflops,
        bandwidth_roof_gflops: roof,
        attainable_gflops: attainable,
        bound,
        ridge_intensity: peak_gflops.map(|p| p / bandwidth_gbps),
    })
}

/// A number for people: integers without a fraction, others to six
/// significant digits with trailing zeros dropped.
pub fn num(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e15 {
        return format!("{v:.0}");
    }
    if v.abs() < 1e-3 {
        return format!("{v:.3e}");
    }
    let digits = (5 - v.abs().log10().floor() as i32).clamp(0, 12) as usize;
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `kvwire roofline`: validate, compute, render.
pub fn roofline_cmd(a: RooflineArgs, out: &mut String) -> Result<(), Error> {
    let bad = |e: RooflineError| Error::BadInput(e.into());
    let i = positive("--intensity", &a.intensity).map_err(bad)?;
    let b = positive("--bandwidth", &a.bandwidth).map_err(bad)?;
    let p = a.peak.as_deref().map(|t| positive("--peak", t)).transpose().map_err(bad)?;
    let r = roofline(i, b, p).map_err(bad)?;
    if a.json {
        out.push_str(&serde_json::to_string_pretty(&r).expect("roofline serializes"));
        out.push('\n');
        return Ok(());
    }
    let _ = writeln!(out, "intensity   I = {} FLOP/byte", num(r.intensity));
    let _ = writeln!(out, "bandwidth   B = {} GB/s", num(r.bandwidth_gbps));
    match r.peak_gflops {
        Some(p) => {
            let _ = writeln!(out, "peak        P = {} GFLOP/s", num(p));
            let _ = writeln!(
                out,
                "attainable  min(P, I × B) = min({}, {}) = {} GFLOP/s",
                num(p),
                num(r.bandwidth_roof_gflops),
                num(r.attainable_gflops)
            );
        }
        None => {
            let _ = writeln!(out, "peak        P = none given (only the bandwidth roof applies)");
            let _ = writeln!(out, "attainable  I × B = {} GFLOP/s", num(r.attainable_gflops));
        }
    }
    match r.ridge_intensity {
        Some(ridge) => {
            let _ = writeln!(out, "bound       {} (ridge at I = P / B = {} FLOP/byte)", r.bound.as_str(), num(ridge));
        }
        None => {
            let _ = writeln!(out, "bound       {}", r.bound.as_str());
        }
    }
    Ok(())
}

// ------------------------------------------------------------ campaign JSONL

// The leaf records (latency, baselines, hops) are the campaign's own:
// the writer and this reader share one type for each.

/// One `{"kind":"point",…}` line of `campaign.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// Backend.
    pub transport: String,
    /// Bytes per transfer.
    pub size: u64,
    /// Transfers in flight at once.
    pub concurrency: u32,
    /// Chunk size, bytes.
    pub chunk: u64,
    /// Pipeline depth.
    pub depth: u32,
    /// Timed transfers.
    pub iterations: u32,
    /// Average throughput, GB/s.
    pub gbps_avg: f64,
    /// Best throughput, GB/s.
    pub gbps_peak: f64,
    /// End-to-end latency.
    pub lat_ns: LatNs,
    /// Payload bytes moved.
    pub payload_bytes: u64,
    /// Bytes on the wire, framing included.
    pub wire_bytes: u64,
    /// Baselines measured in the same run.
    #[serde(default)]
    pub baselines: Vec<Baseline>,
    /// Per-hop summaries, by hop name.
    #[serde(default)]
    pub hops: BTreeMap<String, HopStat>,
    /// The timing model per transfer on average (absent from campaigns
    /// written before it was kept).
    #[serde(default)]
    pub model: Option<Prediction>,
}

/// The hops in transfer order; a hop not listed here sorts after them, by name.
pub const HOP_ORDER: [&str; 9] = ["pack", "stage", "post", "wire", "place", "device_complete", "unpack", "verify", "notify"];

fn hop_rank(name: &str) -> (usize, &str) {
    (HOP_ORDER.iter().position(|h| *h == name).unwrap_or(HOP_ORDER.len()), name)
}

/// One measured hop seen as a bandwidth roof.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Roof {
    /// Hop name.
    pub hop: String,
    /// Its effective bandwidth, GB/s.
    pub gbps: f64,
}

impl Point {
    /// The point's hops in transfer order, as they appear in the JSON.
    pub fn hops_in_order(&self) -> Vec<(&str, &HopStat)> {
        let mut v: Vec<_> = self.hops.iter().map(|(k, h)| (k.as_str(), h)).collect();
        v.sort_by_key(|(k, _)| hop_rank(k));
        v
    }

    /// Every measured hop (bytes and time both > 0) as a roof, in transfer order.
    pub fn roofs(&self) -> Vec<Roof> {
        self.hops_in_order().into_iter().filter_map(|(k, h)| h.gbps().map(|g| Roof { hop: k.into(), gbps: g })).collect()
    }

    /// The lowest roof: the hop that bounds the transfer (first one on a tie).
    pub fn lowest_roof(&self) -> Option<Roof> {
        self.roofs().into_iter().reduce(|a, b| if b.gbps < a.gbps { b } else { a })
    }
}

/// A parsed campaign file.
#[derive(Debug, Clone, PartialEq)]
pub struct Campaign {
    /// The points, in file order.
    pub points: Vec<Point>,
    /// The same points exactly as read (every field kept), for the page's JSON.
    pub raw: Vec<serde_json::Value>,
    /// Lines of another `kind`, counted by kind.
    pub other_kinds: BTreeMap<String, usize>,
}

/// Why a campaign file was refused; `line` counts from 1.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CampaignError {
    /// The line is not JSON.
    #[error("line {line}: not JSON: {message}")]
    Json {
        /// Line number.
        line: usize,
        /// The parser's message.
        message: String,
    },
    /// The line is JSON but not an object with a string `kind`.
    #[error("line {line}: expected an object with a string \"kind\"")]
    NoKind {
        /// Line number.
        line: usize,
    },
    /// A `point` whose fields do not match the schema.
    #[error("line {line}: bad point: {message}")]
    BadPoint {
        /// Line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// No `point` lines at all.
    #[error("no {{\"kind\":\"point\"}} lines ({lines} lines read)")]
    NoPoints {
        /// Non-empty lines read.
        lines: usize,
    },
}

/// Parses campaign JSONL: one object per line, blank lines skipped; `point`
/// lines are checked against the schema, other kinds are counted and kept out.
pub fn parse_campaign(text: &str) -> Result<Campaign, CampaignError> {
    let mut c = Campaign { points: Vec::new(), raw: Vec::new(), other_kinds: BTreeMap::new() };
    let mut lines = 0;
    for (i, l) in text.lines().enumerate() {
        let line = i + 1;
        if l.trim().is_empty() {
            continue;
        }
        lines += 1;
        let v: serde_json::Value = serde_json::from_str(l).map_err(|e| CampaignError::Json { line, message: e.to_string() })?;
        let kind = v.get("kind").and_then(|k| k.as_str()).ok_or(CampaignError::NoKind { line })?;
        if kind != "point" {
            *c.other_kinds.entry(kind.to_string()).or_default() += 1;
            continue;
        }
        let p: Point = serde_json::from_value(v.clone()).map_err(|e| CampaignError::BadPoint { line, message: e.to_string() })?;
        let bad = |message: String| CampaignError::BadPoint { line, message };
        for (name, g) in [("gbps_avg", p.gbps_avg), ("gbps_peak", p.gbps_peak)] {
            if !(g.is_finite() && g >= 0.0) {
                return Err(bad(format!("{name} must be ≥ 0, got {g}")));
            }
        }
        if p.size == 0 {
            return Err(bad("size must be > 0".into()));
        }
        if let Some(b) = p.baselines.iter().find(|b| !(b.gbps.is_finite() && b.gbps >= 0.0)) {
            return Err(bad(format!("baseline {} gbps must be ≥ 0, got {}", b.name, b.gbps)));
        }
        c.points.push(p);
        c.raw.push(v);
    }
    if c.points.is_empty() {
        return Err(CampaignError::NoPoints { lines });
    }
    Ok(c)
}

// ------------------------------------------------------------ HTML

/// Escapes text for HTML element content and quoted attribute values.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// JSON that is safe inside `<script type="application/json">`: `<`, `>`
/// and `&` (which JSON only allows inside strings) become `\u` escapes.
pub fn script_json(v: &serde_json::Value) -> String {
    serde_json::to_string(v).expect("JSON value serializes").replace('<', "\\u003c").replace('>', "\\u003e").replace('&', "\\u0026")
}

/// `65536` → `64 KiB`.
pub fn size_label(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut u) = (n as f64, 0);
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{} {}", num((v * 10.0).round() / 10.0), UNITS[u])
    }
}

/// Nanoseconds for people: `950 ns`, `12.3 µs`, `4.56 ms`, `1.20 s`.
pub fn ns_label(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.1} µs", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.2} s", ns / 1e9)
    }
}

const PALETTE: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];

/// Points grouped into plot series: same transport, concurrency and depth,
/// and same chunk where the campaign sweeps chunk sizes at a fixed size
/// (a chunk that merely follows the size, `min(size, chunk)`, splits nothing).
struct Series {
    label: String,
    color: &'static str,
    /// Indices into the campaign's points, by size.
    points: Vec<usize>,
}

fn series(points: &[Point]) -> Vec<Series> {
    let swept = points.iter().any(|a| {
        points.iter().any(|b| (&a.transport, a.concurrency, a.depth, a.size) == (&b.transport, b.concurrency, b.depth, b.size) && a.chunk != b.chunk)
    });
    let key = |p: &Point| (p.transport.clone(), p.concurrency, if swept { p.chunk } else { 0 }, p.depth);
    type Key = (String, u32, u64, u32);
    let mut groups: Vec<(Key, Vec<usize>)> = Vec::new();
    for (i, p) in points.iter().enumerate() {
        match groups.iter_mut().find(|(k, _)| *k == key(p)) {
            Some((_, v)) => v.push(i),
            None => groups.push((key(p), vec![i])),
        }
    }
    let varies = |f: &dyn Fn(&Point) -> u64| points.iter().any(|p| f(p) != f(&points[0]));
    let (vc, vk, vd) = (varies(&|p| p.concurrency.into()), swept, varies(&|p| p.depth.into()));
    groups
        .into_iter()
        .enumerate()
        .map(|(n, ((t, c, k, d), mut idx))| {
            idx.sort_by_key(|&i| points[i].size);
            let mut label = t;
            if vc {
                let _ = write!(label, " ×{c}");
            }
            if vk {
                let _ = write!(label, " chunk {}", size_label(k));
            }
            if vd {
                let _ = write!(label, " depth {d}");
            }
            Series { label, color: PALETTE[n % PALETTE.len()], points: idx }
        })
        .collect()
}

/// One line on a chart: (x, y) pairs already in data units.
struct Line<'a> {
    color: &'a str,
    dashed: bool,
    title: String,
    xy: Vec<(f64, f64)>,
}

/// An SVG line chart with a log₂ size x axis; y is linear from 0, or log₁₀.
fn chart(title: &str, y_label: &str, y_log: bool, y_fmt: &dyn Fn(f64) -> String, sizes: &[u64], lines: &[Line<'_>]) -> String {
    const W: f64 = 440.0;
    const H: f64 = 260.0;
    const L: f64 = 64.0;
    const R: f64 = 14.0;
    const T: f64 = 26.0;
    const B: f64 = 40.0;
    let mut s = String::new();
    let _ = write!(s, r#"<svg class="chart" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{}">"#, esc(title));
    let _ = write!(s, r#"<text x="{}" y="16" class="ctitle" text-anchor="middle">{}</text>"#, W / 2.0, esc(title));
    let ys: Vec<f64> = lines.iter().flat_map(|l| l.xy.iter().map(|p| p.1)).filter(|y| y.is_finite() && (!y_log || *y > 0.0)).collect();
    if ys.is_empty() || sizes.is_empty() {
        let _ = write!(s, r#"<text x="{}" y="{}" text-anchor="middle" class="muted">no data</text></svg>"#, W / 2.0, H / 2.0);
        return s;
    }
    let (x0, x1) = {
        let lo = (*sizes.iter().min().expect("sizes")) as f64;
        let hi = (*sizes.iter().max().expect("sizes")) as f64;
        if lo == hi {
            (lo.log2() - 1.0, hi.log2() + 1.0)
        } else {
            let pad = (hi.log2() - lo.log2()) * 0.06;
            (lo.log2() - pad, hi.log2() + pad)
        }
    };
    let ymax = ys.iter().copied().fold(f64::MIN, f64::max);
    let ymin = ys.iter().copied().fold(f64::MAX, f64::min);
    let (y0, y1, ticks): (f64, f64, Vec<f64>) = if y_log {
        let lo = ymin.log10().floor();
        let hi = (ymax.log10().ceil()).max(lo + 1.0);
        (lo, hi, (lo as i32..=hi as i32).map(|e| 10f64.powi(e)).collect())
    } else {
        let top = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
        let step = nice_step(top / 5.0);
        let n = (top / step).ceil() as i32;
        (0.0, step * n as f64, (0..=n).map(|i| step * i as f64).collect())
    };
    let px = |x: f64| L + (x.log2() - x0) / (x1 - x0) * (W - L - R);
    let py = |y: f64| {
        let v = if y_log { y.log10() } else { y };
        H - B - (v - y0) / (y1 - y0) * (H - T - B)
    };
    let _ = write!(s, r#"<rect x="{L}" y="{T}" width="{}" height="{}" class="plotbg"/>"#, W - L - R, H - T - B);
    for t in &ticks {
        let y = py(*t);
        let _ = write!(s, r#"<line x1="{L}" x2="{}" y1="{y:.1}" y2="{y:.1}" class="grid"/>"#, W - R);
        let _ = write!(s, r#"<text x="{}" y="{:.1}" text-anchor="end" class="tick">{}</text>"#, L - 4.0, y + 3.5, esc(&y_fmt(*t)));
    }
    let mut uniq: Vec<u64> = sizes.to_vec();
    uniq.sort_unstable();
    uniq.dedup();
    for sz in &uniq {
        let x = px(*sz as f64);
        let _ = write!(s, r#"<line x1="{x:.1}" x2="{x:.1}" y1="{T}" y2="{}" class="grid"/>"#, H - B);
        let _ = write!(s, r#"<text x="{x:.1}" y="{}" text-anchor="middle" class="tick">{}</text>"#, H - B + 14.0, esc(&size_label(*sz)));
    }
    let _ = write!(s, r#"<text x="{}" y="{}" text-anchor="middle" class="axis">transfer size</text>"#, L + (W - L - R) / 2.0, H - 6.0);
    let _ = write!(s, r#"<text transform="translate(13 {}) rotate(-90)" text-anchor="middle" class="axis">{}</text>"#, T + (H - T - B) / 2.0, esc(y_label));
    for l in lines {
        let pts: Vec<(f64, f64)> = l.xy.iter().copied().filter(|(_, y)| y.is_finite() && (!y_log || *y > 0.0)).collect();
        if pts.is_empty() {
            continue;
        }
        let path: Vec<String> = pts.iter().map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y))).collect();
        let dash = if l.dashed { r#" stroke-dasharray="5 3""# } else { "" };
        let _ = write!(s, r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}><title>{}</title></polyline>"#, path.join(" "), l.color, esc(&l.title));
        for (x, y) in &pts {
            let _ = write!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"><title>{}: {} at {}</title></circle>"#,
                px(*x),
                py(*y),
                l.color,
                esc(&l.title),
                esc(&y_fmt(*y)),
                esc(&size_label(*x as u64))
            );
        }
    }
    s.push_str("</svg>");
    s
}

/// 1, 2 or 5 × 10ⁿ, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let e = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * e).find(|s| *s >= raw).unwrap_or(10.0 * e)
}

fn gbps_fmt(v: f64) -> String {
    num(v)
}

fn ns_fmt(v: f64) -> String {
    ns_label(v)
}

fn plots(points: &[Point], series: &[Series]) -> String {
    let sizes: Vec<u64> = points.iter().map(|p| p.size).collect();
    let mut out = String::new();
    out.push_str(r#"<div class="legend">"#);
    for s in series {
        let _ = write!(out, r#"<span class="key"><span class="swatch" style="background:{}"></span>{}</span>"#, s.color, esc(&s.label));
    }
    out.push_str(r#"<span class="key muted">solid: GB/s avg or p50 · dashed: GB/s peak or p99</span></div>"#);
    out.push_str(r#"<div class="charts">"#);
    let xy = |s: &Series, f: &dyn Fn(&Point) -> Option<f64>| -> Vec<(f64, f64)> {
        s.points.iter().filter_map(|&i| f(&points[i]).map(|y| (points[i].size as f64, y))).collect()
    };
    let mut lines = Vec::new();
    for s in series {
        lines.push(Line { color: s.color, dashed: false, title: format!("{} GB/s avg", s.label), xy: xy(s, &|p| Some(p.gbps_avg)) });
        lines.push(Line { color: s.color, dashed: true, title: format!("{} GB/s peak", s.label), xy: xy(s, &|p| Some(p.gbps_peak)) });
    }
    out.push_str(&chart("throughput vs size", "GB/s", false, &gbps_fmt, &sizes, &lines));
    let mut lat = Vec::new();
    for s in series {
        lat.push(Line { color: s.color, dashed: false, title: format!("{} end-to-end p50", s.label), xy: xy(s, &|p| Some(p.lat_ns.p50 as f64)) });
        lat.push(Line { color: s.color, dashed: true, title: format!("{} end-to-end p99", s.label), xy: xy(s, &|p| p.lat_ns.p99.map(|v| v as f64)) });
    }
    out.push_str(&chart("end-to-end latency (lat_ns)", "latency", true, &ns_fmt, &sizes, &lat));
    let mut hop_names: Vec<&str> = points.iter().flat_map(|p| p.hops.keys().map(String::as_str)).collect();
    hop_names.sort_by_key(|k| hop_rank(k));
    hop_names.dedup();
    for hop in hop_names {
        let mut ls = Vec::new();
        for s in series {
            let get = |p: &Point, f: fn(&HopStat) -> Option<u64>| p.hops.get(hop).filter(|h| h.count > 0).and_then(f).map(|v| v as f64);
            ls.push(Line { color: s.color, dashed: false, title: format!("{} {hop} p50", s.label), xy: xy(s, &|p| get(p, |h| Some(h.p50_ns))) });
            ls.push(Line { color: s.color, dashed: true, title: format!("{} {hop} p99", s.label), xy: xy(s, &|p| get(p, |h| h.p99_ns)) });
        }
        out.push_str(&chart(&format!("hop {hop}: latency per event"), "latency", true, &ns_fmt, &sizes, &ls));
    }
    out.push_str("</div>");
    out
}

fn table(points: &[Point]) -> String {
    let mut t = String::new();
    t.push_str(
        r#"<table id="points"><thead><tr><th>#</th><th>transport</th><th>size</th><th>conc.</th><th>chunk</th><th>depth</th><th>iters</th><th>GB/s avg</th><th>GB/s peak</th><th>lat min</th><th>p50</th><th>p99</th><th>p99.9</th><th>max</th><th>payload bytes</th><th>wire bytes</th><th>baselines (GB/s)</th><th>lowest hop roof (GB/s)</th><th>mean</th><th>lower bound</th><th>model</th></tr></thead><tbody>"#,
    );
    for (i, p) in points.iter().enumerate() {
        let l = &p.lat_ns;
        let _ = write!(
            t,
            r#"<tr data-index="{i}"><td>{i}</td><td>{}</td><td title="{} bytes">{}</td><td class="n">{}</td><td title="{} bytes">{}</td><td class="n">{}</td><td class="n">{}</td><td class="n gbps-avg">{:.3}</td><td class="n gbps-peak">{:.3}</td>"#,
            esc(&p.transport),
            p.size,
            esc(&size_label(p.size)),
            p.concurrency,
            p.chunk,
            esc(&size_label(p.chunk)),
            p.depth,
            p.iterations,
            p.gbps_avg,
            p.gbps_peak
        );
        for v in [Some(l.min), Some(l.p50), l.p99, l.p999, Some(l.max)] {
            match v {
                Some(v) => {
                    let _ = write!(t, r#"<td class="n" title="{v} ns">{}</td>"#, esc(&ns_label(v as f64)));
                }
                None => t.push_str(r#"<td class="n" title="too few samples for this percentile">n/a</td>"#),
            }
        }
        let _ = write!(t, r#"<td class="n">{}</td><td class="n">{}</td><td>"#, p.payload_bytes, p.wire_bytes);
        let bl: Vec<String> = p.baselines.iter().map(|b| format!("{} {:.3}", esc(&b.name), b.gbps)).collect();
        t.push_str(&bl.join("<br>"));
        t.push_str("</td><td>");
        match p.lowest_roof() {
            Some(r) => {
                let _ = write!(t, r#"<span class="lowest-hop">{}</span> <span class="lowest-gbps">{:.3}</span>"#, esc(&r.hop), r.gbps);
            }
            None => t.push_str(r#"<span class="muted">no measured hop</span>"#),
        }
        t.push_str("</td>");
        match &p.model {
            Some(m) => {
                let fit = fit_label(m);
                let class = if model_error("", m).is_some() { "model model-error" } else { "model" };
                let _ = write!(
                    t,
                    r#"<td class="n" title="{} ns">{}</td><td class="n" title="{} ns, bounded by {}">{}</td><td class="{class}">{}</td>"#,
                    m.measured_ns.unwrap_or(0),
                    esc(&ns_label(m.measured_ns.unwrap_or(0) as f64)),
                    m.lower_ns,
                    esc(m.bounding.as_deref().unwrap_or("no hop")),
                    esc(&ns_label(m.lower_ns as f64)),
                    esc(&fit)
                );
            }
            None => t.push_str(r#"<td colspan="3" class="muted">not in this campaign</td>"#),
        }
        t.push_str("</tr>");
    }
    t.push_str("</tbody></table>");
    t
}

const TEMPLATE: &str = include_str!("report.html");

/// Fills `{{NAME}}` placeholders in one pass: inserted text is never rescanned.
fn fill(template: &str, vars: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(template.len() * 2);
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find("}}").map(|end| (&after[..end], end)) {
            Some((name, end)) if vars.iter().any(|(k, _)| *k == name) => {
                out.push_str(vars.iter().find(|(k, _)| *k == name).map(|(_, v)| *v).unwrap_or_default());
                rest = &after[end + 2..];
            }
            _ => {
                out.push_str("{{");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The whole page: one self-contained HTML document (inline CSS, JS and
/// SVG; nothing fetched). `source` says where the points came from.
pub fn render_html(c: &Campaign, source: &str) -> String {
    let series = series(&c.points);
    let data = serde_json::json!({
        "generator": format!("kvwire {}", env!("CARGO_PKG_VERSION")),
        "source": source,
        "points": c.raw,
    });
    let mut notes = String::new();
    // A mean below its lower bound is the model's failure, said at the top.
    for (i, p) in c.points.iter().enumerate() {
        let what = format!("#{i} {} {} ×{}", p.transport, size_label(p.size), p.concurrency);
        if let Some(line) = p.model.as_ref().and_then(|m| model_error(&what, m)) {
            let _ = write!(notes, "<p class=\"model-error\">{}</p>", esc(&line));
        }
    }
    if !c.other_kinds.is_empty() {
        let kinds: Vec<String> = c.other_kinds.iter().map(|(k, n)| format!("{n} × {}", esc(k))).collect();
        let _ = write!(notes, "<p class=\"muted\">Lines of other kinds not shown: {}.</p>", kinds.join(", "));
    }
    let options: String = c
        .points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                r#"<option value="{i}">#{i} {} {} ×{} chunk {} depth {}</option>"#,
                esc(&p.transport),
                esc(&size_label(p.size)),
                p.concurrency,
                esc(&size_label(p.chunk)),
                p.depth
            )
        })
        .collect();
    fill(
        TEMPLATE,
        &[
            ("SOURCE", &esc(source)),
            ("COUNT", &c.points.len().to_string()),
            ("VERSION", env!("CARGO_PKG_VERSION")),
            ("NOTES", &notes),
            ("TABLE", &table(&c.points)),
            ("PLOTS", &plots(&c.points, &series)),
            ("OPTIONS", &options),
            ("DATA", &script_json(&data)),
        ],
    )
}

// ------------------------------------------------------------ kvwire report

/// Raw arguments of `kvwire report`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Write an HTML page (the only format so far; required).
    #[arg(long)]
    html: bool,
    /// The page to write.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Campaign JSONL (`kvwire bench campaign --out DIR` writes DIR/campaign.jsonl).
    /// Without it, a short default campaign runs first on loopback, into
    /// FILE's name with the extension `.campaign` (a directory, kept).
    #[arg(long, value_name = "CAMPAIGN.jsonl")]
    from: Option<PathBuf>,
}

/// What the default campaign runs: `kvwire` followed by these.
pub const DEFAULT_CAMPAIGN: [&str; 8] = ["bench", "campaign", "--transports", "tcp,shm", "--sizes", "64K,4M", "--iterations", "3"];

/// Runs `kvwire bench campaign … --out DIR` (this very executable) and
/// returns its JSONL text and the campaign's stdout. DIR is kept: it holds
/// the campaign.jsonl to pass as `--from` next time, and the campaign's own SVGs.
fn default_campaign(dir: &Path) -> anyhow::Result<(String, String)> {
    let exe = std::env::current_exe().context("cannot find the running kvwire executable")?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join("campaign.jsonl");
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(anyhow!(e).context(format!("cannot remove the old {}", path.display())));
        }
        _ => {}
    }
    let cmdline = format!("kvwire {} --out {}", DEFAULT_CAMPAIGN.join(" "), dir.display());
    eprintln!("kvwire: no --from given; running the default campaign: {cmdline}");
    let o = std::process::Command::new(&exe)
        .args(DEFAULT_CAMPAIGN)
        .arg("--out")
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("cannot run {}", exe.display()))?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    if !o.status.success() {
        let missing = stderr.contains("unrecognized subcommand") || stderr.contains("unexpected argument");
        if missing && stderr.contains("campaign") {
            return Err(anyhow!(
                "this kvwire has no `bench campaign` yet, so there is no default campaign to run; pass --from CAMPAIGN.jsonl"
            ));
        }
        let first = stderr.lines().find(|l| !l.trim().is_empty()).unwrap_or("(no stderr)");
        return Err(anyhow!("the default campaign failed ({}): {first}", o.status).context(cmdline));
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("the default campaign wrote no {}", path.display()))?;
    Ok((text, String::from_utf8_lossy(&o.stdout).into_owned()))
}

/// Refuses an `--out` whose directory does not exist, before any campaign runs.
fn check_out(path: &Path) -> anyhow::Result<()> {
    if path.as_os_str().is_empty() || path.is_dir() {
        return Err(anyhow!("--out {} is not a file path", path.display()));
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(anyhow!("--out {}: directory {} does not exist", path.display(), parent.display()));
    }
    Ok(())
}

/// `kvwire report --html --out FILE [--from CAMPAIGN.jsonl]`.
pub fn report_cmd(a: ReportArgs, out: &mut String) -> Result<(), Error> {
    if !a.html {
        return Err(Error::BadInput(anyhow!("say which format to write: --html (the only one so far)")));
    }
    check_out(&a.out).map_err(Error::BadInput)?;
    let (campaign, source) = match &a.from {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read --from {}", path.display()))
                .map_err(Error::BadInput)?;
            let c = parse_campaign(&text).with_context(|| format!("campaign file {}", path.display())).map_err(Error::BadInput)?;
            (c, path.display().to_string())
        }
        None => {
            let dir = a.out.with_extension("campaign");
            let (text, table) = default_campaign(&dir).map_err(Error::Failed)?;
            out.push_str(&table);
            let jsonl = dir.join("campaign.jsonl");
            let c = parse_campaign(&text).with_context(|| format!("the default campaign's {}", jsonl.display())).map_err(Error::Failed)?;
            (c, jsonl.display().to_string())
        }
    };
    let page = render_html(&campaign, &source);
    let tmp = a.out.with_extension("html.tmp");
    if let Err(e) = std::fs::write(&tmp, &page).and_then(|()| std::fs::rename(&tmp, &a.out)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::Failed(anyhow!(e).context(format!("cannot write --out {}", a.out.display()))));
    }
    let _ = writeln!(out, "wrote {} ({} points, {} bytes) from {source}", a.out.display(), campaign.points.len(), page.len());
    Ok(())
}
