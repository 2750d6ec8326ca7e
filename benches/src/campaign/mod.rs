//! `kvwire bench campaign`: a latency and throughput sweep over transports,
//! transfer sizes and concurrency, through real endpoints, with in-run
//! baselines next to every point.
//!
//! A point is (transport, size, concurrency). For each point the campaign
//! makes fresh endpoints (so their hop histograms hold that point only),
//! runs one warm-up round through a twin pair of endpoints on the same
//! memory (pages faulted in, threads spun up, without touching the measured
//! histograms), then `iterations` timed rounds. A round is `concurrency`
//! transfers started together behind a barrier, each on its own connection
//! from the one source endpoint to the one destination endpoint, each in
//! its own thread: they share one link. A transfer is `size` bytes split
//! into `chunk`-byte writes, one batch each, with at most `depth` batches
//! outstanding; it is timed from the first post until the destination's
//! layer flag is seen (DESIGN.md `layer_ready`).
//!
//! Figures (GB/s = 1e9 bytes/s, which is exactly bytes per nanosecond):
//! - `gbps_avg`: each transfer's effective bandwidth, averaged as bytes over
//!   summed transfer time; `gbps_peak`: the fastest transfer;
//! - `gbps_aggregate`: all bytes of a round over the round's wall time
//!   (first start to last flag), summed over rounds — what the shared link
//!   carried. With concurrency 1 it equals `gbps_avg` up to rounding;
//! - `lat_ns`: per-transfer latency, min / p50 / p99 / p99.9 / max, from an
//!   hdrhistogram (3 significant digits) of every timed transfer; p99 only
//!   from 100 transfers on and p99.9 from 1000 (`null` and `n/a` below:
//!   with fewer samples either is only the max);
//! - `payload_bytes`: `size × concurrency × iterations` (timed transfers);
//!   `wire_bytes`: that plus the framing its connections report sending and
//!   getting back for those transfers
//!   (tcp: a 40-byte header per frame and a 40-byte ack; shm: an 80-byte
//!   write request and a 40-byte ack per write; verbs: a 24-byte write
//!   note per range written). Link-level headers (TCP/IP, RoCE) are not counted;
//! - `baselines`: `memcpy` always, then the transport's own raw path —
//!   `tcp socket pair` for tcp, `ib_write_bw` for verbs — each measured in
//!   this run right after the point, with the same concurrency. The
//!   table's ratio is `gbps_avg` over the last baseline, except against
//!   `ib_write_bw`: it runs one QP per transfer (`-q`) and reports their
//!   sum, so the ratio is `gbps_aggregate` over it;
//! - `hops`: post from the source endpoint's
//!   [`Hops`](kvwire_transport::Hops), place from the destination's; wire
//!   and notify timed by the campaign: wire from post returned to
//!   completion seen, clipped at the transfer's end (a late ack would
//!   otherwise give a hop longer than its transfer), notify from the flag's
//!   publish to the campaign seeing it. Every hop sample lies inside its
//!   transfer, so no hop's max exceeds `lat_ns.max`; a hop's p99 follows the
//!   rule of `lat_ns`.
//!
//! - `model`: the timing model per transfer on average
//!   ([`figures::model`]): post, wire (the union of a transfer's writes in
//!   flight), place and notify as stages, the writes as chunks, against the
//!   mean latency. Its lower bound is a bound; a mean below it is printed as
//!   `MODEL ERROR` with the numbers, never as overlap.
//!
//! Outputs: a fixed-width table (or, with `--json`, the JSONL lines),
//! `DIR/campaign.jsonl` (one `{"kind":"point",…}` object per point, and one
//! `{"kind":"skipped",…}` object per transport that could not run), and
//! three SVG plots drawn by [`crate::svg`].
//!
//! Modules: `settings` (the arguments and their validation), `records` (the
//! JSONL records), `figures` (a point's figures, pure), `measure` (endpoints
//! and timed transfers), `baselines` (the in-run baselines), `table` and
//! `plots` (the outputs); [`run`] ties them together.

mod baselines;
mod figures;
mod lockstep;
mod measure;
mod plots;
mod records;
mod settings;
mod table;
#[cfg(test)]
mod tests;

pub use figures::{chunks, figures, fit_label, model, model_error, size_label, supports, Figures, Sample};
pub use plots::{hop_ceiling_svg, hop_latency_svg, throughput_svg};
pub use records::{Baseline, HopStat, LatNs, Point, PointHops, Skipped};
pub use settings::{CampaignArgs, Settings};
pub use table::render_table;

use crate::Error;
use anyhow::{anyhow, Context};
use kvwire_core::protocol::TransportKind;
use kvwire_transport::verbs::VerbsLimits;
use kvwire_transport::TransportError;
use measure::{measure, verbs_endpoint};
use std::fmt::Write as _;
use std::io::{IsTerminal as _, Write as _};

/// Runs the campaign and renders it into `out`.
pub fn run(a: CampaignArgs, out: &mut String) -> Result<(), Error> {
    let s = a.settings().map_err(Error::BadInput)?;
    std::fs::create_dir_all(&s.out).with_context(|| format!("--out {}: cannot create the directory", s.out.display())).map_err(Error::BadInput)?;
    let jsonl_path = s.out.join("campaign.jsonl");
    let mut jsonl = std::fs::File::create(&jsonl_path).with_context(|| format!("--out: cannot write {}", jsonl_path.display())).map_err(Error::BadInput)?;
    let mut line = |v: &dyn erased::Line, out: &mut String| -> Result<(), Error> {
        let text = v.to_line();
        writeln!(jsonl, "{text}").and_then(|()| jsonl.flush()).with_context(|| format!("write {}", jsonl_path.display())).map_err(Error::Failed)?;
        if s.json {
            out.push_str(&text);
            out.push('\n');
        }
        Ok(())
    };
    let progress = std::io::stderr().is_terminal();
    let mut points = Vec::new();
    let mut skipped = Vec::new();
    let total = s.transports.len() * s.sizes.len() * s.concurrency.len();
    let mut done = 0;
    for &t in &s.transports {
        if t == TransportKind::Verbs {
            match verbs_endpoint(VerbsLimits { node: "campaign-probe".into(), slots: 1, layers: 1, ..VerbsLimits::default() }) {
                Ok(_) => {}
                Err(TransportError::NoDevice(why)) => {
                    let n = s.sizes.len() * s.concurrency.len();
                    eprintln!("kvwire: WARNING: SKIPPING all {n} verbs points: no RDMA device: {why}");
                    let sk = Skipped { kind: "skipped", transport: t.as_str(), reason: format!("no RDMA device: {why}") };
                    line(&sk, out)?;
                    skipped.push(sk);
                    done += n;
                    continue;
                }
                Err(e) => return Err(Error::Failed(anyhow!(e).context("verbs endpoint"))),
            }
        }
        for &size in &s.sizes {
            for &c in &s.concurrency {
                done += 1;
                if progress {
                    eprintln!("kvwire: campaign point {done}/{total}: {} {} conc {c}", t.as_str(), size_label(size));
                }
                let p = measure(t, size, c, &s)
                    .with_context(|| format!("{} {} bytes, concurrency {c}", t.as_str(), size))
                    .map_err(Error::Failed)?;
                if let Some(e) = model_error(&format!("{} {} conc {c}", t.as_str(), size_label(size)), &p.model) {
                    // Loud in JSON mode too, where no table follows.
                    eprintln!("kvwire: {e}");
                }
                line(&p, out)?;
                points.push(p);
            }
        }
    }
    let plots = [
        ("throughput_vs_size.svg", throughput_svg(&points)),
        ("hop_latency.svg", hop_latency_svg(&points)),
        ("hop_ceiling.svg", hop_ceiling_svg(&points)),
    ];
    for (name, doc) in &plots {
        let p = s.out.join(name);
        std::fs::write(&p, doc).with_context(|| format!("write {}", p.display())).map_err(Error::Failed)?;
    }
    if !s.json {
        render_table(&s, &points, &skipped, out);
        let names: Vec<&str> = plots.iter().map(|(n, _)| *n).collect();
        let _ = writeln!(out, "wrote campaign.jsonl and {} in {}", names.join(", "), s.out.display());
    }
    Ok(())
}

/// Serializing the two kinds of JSONL line through one closure.
mod erased {
    pub trait Line {
        fn to_line(&self) -> String;
    }
    impl<T: serde::Serialize> Line for T {
        fn to_line(&self) -> String {
            serde_json::to_string(self).expect("campaign records serialize")
        }
    }
}
