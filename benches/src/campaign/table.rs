//! The fixed-width table printed without `--json`.

use super::figures::{fit_label, model_error, size_label};
use super::records::{Point, Skipped};
use super::settings::Settings;
use std::fmt::Write as _;

/// The fixed-width table, perftest / Mooncake-bench style.
pub fn render_table(s: &Settings, points: &[Point], skipped: &[Skipped], out: &mut String) {
    let _ = writeln!(
        out,
        "kvwire bench campaign: chunk {}, depth {}, {} iterations per point after 1 warm-up round; latency = first post -> destination flag seen",
        size_label(s.chunk),
        s.depth,
        s.iterations
    );
    let _ = writeln!(
        out,
        "{:<9} {:>6} {:>4} {:>5} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>15} {:>9} {:>6} {:>10} {:>10} {:>16}",
        "transport", "size", "conc", "iters", "GB/s avg", "GB/s peak", "GB/s agg", "min µs", "p50 µs", "p99 µs", "p99.9 µs", "max µs", "baseline", "base GB/s", "ratio",
        "mean µs", "bound µs", "model"
    );
    let us = |ns: u64| format!("{:.1}", ns as f64 / 1e3);
    let tail = |ns: Option<u64>| ns.map_or("n/a".into(), us);
    for p in points {
        let base = p.baselines.last();
        let _ = writeln!(
            out,
            "{:<9} {:>6} {:>4} {:>5} {:>9.3} {:>9.3} {:>9.3} {:>10} {:>10} {:>10} {:>10} {:>10} {:>15} {:>9.3} {:>6} {:>10} {:>10} {:>16}",
            p.transport,
            size_label(p.size),
            p.concurrency,
            p.iterations,
            p.gbps_avg,
            p.gbps_peak,
            p.gbps_aggregate,
            us(p.lat_ns.min),
            us(p.lat_ns.p50),
            tail(p.lat_ns.p99),
            tail(p.lat_ns.p999),
            us(p.lat_ns.max),
            base.map_or("-", |b| b.name.as_str()),
            base.map_or(0.0, |b| b.gbps),
            p.ratio().map_or("-".into(), |r| format!("{r:.3}")),
            us(p.model.measured_ns.unwrap_or(0)),
            us(p.model.lower_ns),
            fit_label(&p.model)
        );
    }
    for p in points {
        let what = format!("{} {} conc {}", p.transport, size_label(p.size), p.concurrency);
        if let Some(line) = model_error(&what, &p.model) {
            let _ = writeln!(out, "{line}");
        }
    }
    for sk in skipped {
        let _ = writeln!(out, "{:<9} SKIPPED: {}", sk.transport, sk.reason);
    }
    let _ = writeln!(
        out,
        "GB/s = 1e9 bytes/s. avg: each transfer's effective bandwidth (bytes / summed transfer time); peak: fastest transfer; \
         agg: all bytes of a round / that round's wall time."
    );
    let _ = writeln!(
        out,
        "p99 needs at least 100 transfers (conc x iters), p99.9 at least 1000; with fewer they are n/a, not the max under another name."
    );
    let _ = writeln!(
        out,
        "conc c: c transfers at once sharing one link (c connections from one source endpoint to one destination, one thread each). \
         A duration measured alone (conc 1) must not be subtracted from a latency budget that runs under contention: \
         read the row with the concurrency the budget runs at."
    );
    let _ = writeln!(
        out,
        "model, per transfer on average: mean = mean latency; bound = the lower bound, the busiest of post, wire (writes in flight, \
         counted once when several are), place and notify; model = where the mean fell: overlap achieved between the pipelined \
         estimate and the sequential sum, beat estimate, above sequential, or MODEL ERROR (below the bound: the model is wrong)."
    );
    let _ = writeln!(
        out,
        "baseline: measured in this run right after its point, same concurrency; ratio = GB/s avg / baseline (against ib_write_bw, run with one QP per transfer: GB/s agg / its aggregate). \
         memcpy is in campaign.jsonl for every point."
    );
}
