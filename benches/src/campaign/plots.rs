//! The campaign's three SVG plots, drawn with [`crate::svg`].

use super::figures::size_label;
use super::records::Point;
use crate::svg::{Anchor, Frame, Scale, Stroke, Svg, PALETTE};

const W: f64 = 900.0;
const H: f64 = 520.0;

fn decade_label(v: f64) -> String {
    let e = v.log10().round() as i32;
    if e >= 0 {
        format!("{v:.0}")
    } else {
        format!("{v:.*}", (-e) as usize)
    }
}

fn series_label(p: &Point) -> String {
    format!("{} c={}", p.transport, p.concurrency)
}

fn empty_note(svg: &mut Svg, f: &Frame) {
    svg.text((f.left + f.right) / 2.0, (f.top + f.bottom) / 2.0, "no points measured", 14.0, Anchor::Middle, 0.0);
}

fn legend(svg: &mut Svg, x: f64, y: f64, items: &[(String, &str, bool)]) {
    for (i, (label, color, dashed)) in items.iter().enumerate() {
        let yy = y + i as f64 * 18.0;
        let stroke = if *dashed { Stroke::dashed(color, 2.0) } else { Stroke::solid(color, 2.0) };
        svg.line((x, yy), (x + 26.0, yy), stroke);
        svg.text(x + 32.0, yy + 4.0, label, 11.0, Anchor::Start, 0.0);
    }
}

/// Throughput (GB/s avg) against transfer size, log–log; one solid line per
/// transport and concurrency, baselines dashed.
pub fn throughput_svg(points: &[Point]) -> String {
    let mut svg = Svg::new(W, H, "kvwire campaign: throughput vs transfer size");
    svg.text(W / 2.0, 24.0, "Throughput vs transfer size (per-transfer GB/s avg; baselines dashed)", 15.0, Anchor::Middle, 0.0);
    let (left, right, top, bottom) = (80.0, W - 250.0, 50.0, H - 60.0);
    let sizes: Vec<f64> = dedup_sorted(points.iter().map(|p| p.size as f64));
    let rates = points.iter().flat_map(|p| std::iter::once(p.gbps_avg).chain(p.baselines.iter().map(|b| b.gbps))).filter(|v| *v > 0.0);
    let (lo, hi) = min_max(rates).unwrap_or((0.1, 10.0));
    let (xlo, xhi) = min_max(sizes.iter().copied()).unwrap_or((1024.0, 1048576.0));
    let f = Frame { x: Scale::log(xlo, xhi, left, right), y: Scale::log(lo, hi, bottom, top), left, right, top, bottom };
    f.axes(&mut svg, &sizes, &f.y.ticks(), "transfer size (bytes, log scale)", "GB/s (log scale)", &|v| size_label(v as u64), &decade_label);
    if points.is_empty() {
        empty_note(&mut svg, &f);
        return svg.finish();
    }
    let mut items = Vec::new();
    let mut color = 0;
    // Solid: one line per (transport, concurrency).
    for key in dedup_keys(points.iter().map(series_label)) {
        let c = PALETTE[color % PALETTE.len()];
        color += 1;
        let pts: Vec<(f64, f64)> = points.iter().filter(|p| series_label(p) == key).map(|p| (f.x.at(p.size as f64), f.y.at(p.gbps_avg))).collect();
        svg.path(&pts, Stroke::solid(c, 2.0));
        for (x, y) in &pts {
            svg.circle(*x, *y, 3.5, c);
        }
        items.push((key, c, false));
    }
    // Dashed: one line per (baseline, concurrency), averaged over the points that carry it.
    let keys = dedup_keys(points.iter().flat_map(|p| p.baselines.iter().map(move |b| format!("{} c={}", b.name, p.concurrency))));
    for key in keys {
        let c = PALETTE[color % PALETTE.len()];
        color += 1;
        let mut pts = Vec::new();
        for &size in &sizes {
            let vals: Vec<f64> = points
                .iter()
                .filter(|p| p.size as f64 == size)
                .flat_map(|p| p.baselines.iter().filter(|b| format!("{} c={}", b.name, p.concurrency) == key).map(|b| b.gbps))
                .collect();
            if !vals.is_empty() {
                pts.push((f.x.at(size), f.y.at(vals.iter().sum::<f64>() / vals.len() as f64)));
            }
        }
        svg.path(&pts, Stroke::dashed(c, 1.5));
        if pts.len() == 1 {
            let (x, y) = pts[0];
            svg.line((x - 10.0, y), (x + 10.0, y), Stroke::dashed(c, 1.5));
        }
        items.push((format!("baseline {key}"), c, true));
    }
    legend(&mut svg, right + 20.0, top + 10.0, &items);
    svg.finish()
}

/// Points at the largest size, one group each (transport × concurrency).
fn largest(points: &[Point]) -> (u64, Vec<&Point>) {
    let size = points.iter().map(|p| p.size).max().unwrap_or(0);
    (size, points.iter().filter(|p| p.size == size).collect())
}

/// Per-hop p50 and p99 bars (log µs) per transport and concurrency at the largest size.
pub fn hop_latency_svg(points: &[Point]) -> String {
    let (size, group) = largest(points);
    let mut svg = Svg::new(W, H, "kvwire campaign: per-hop latency");
    svg.text(W / 2.0, 24.0, &format!("Per-hop latency at {} per transfer (p50 and p99 of each hop's histogram)", size_label(size)), 15.0, Anchor::Middle, 0.0);
    let (left, right, top, bottom) = (80.0, W - 120.0, 50.0, H - 80.0);
    let vals = group.iter().flat_map(|p| p.hops.list().into_iter().filter(|(_, h)| h.count > 0).flat_map(|(_, h)| [Some(h.p50_ns), h.p99_ns])).flatten().map(|ns| ns as f64 / 1e3);
    let (lo, hi) = min_max(vals.filter(|v| *v > 0.0)).unwrap_or((0.1, 1000.0));
    let f = Frame { x: Scale::linear(0.0, 1.0, left, right), y: Scale::log(lo, hi, bottom, top), left, right, top, bottom };
    f.axes(&mut svg, &[], &f.y.ticks(), "", "latency, µs (log scale)", &|_| String::new(), &decade_label);
    if group.is_empty() {
        empty_note(&mut svg, &f);
        return svg.finish();
    }
    let (p50c, p99c) = (PALETTE[0], PALETTE[4]);
    let gw = (right - left) / group.len() as f64;
    let bw = gw * 0.8 / 8.0;
    for (g, p) in group.iter().enumerate() {
        let gx = left + g as f64 * gw + gw * 0.1;
        for (i, (name, h)) in p.hops.list().into_iter().enumerate() {
            let x = gx + i as f64 * 2.0 * bw;
            if h.count > 0 {
                // A p99 the samples do not support leaves its bar out.
                for (j, (ns, color)) in [(Some(h.p50_ns), p50c), (h.p99_ns, p99c)].into_iter().enumerate() {
                    let Some(ns) = ns else { continue };
                    let y = f.y.at((ns as f64 / 1e3).max(f.y.range().0));
                    svg.rect(x + j as f64 * bw, y, bw * 0.95, bottom - y, color);
                }
            } else {
                svg.text(x + bw, bottom - 4.0, "n/a", 9.0, Anchor::Middle, 0.0);
            }
            svg.text(x + bw, bottom + 13.0, name, 10.0, Anchor::Middle, 0.0);
        }
        svg.text(left + g as f64 * gw + gw / 2.0, bottom + 30.0, &series_label(p), 12.0, Anchor::Middle, 0.0);
    }
    svg.rect(right + 15.0, top + 10.0, 12.0, 12.0, p50c);
    svg.text(right + 32.0, top + 20.0, "p50", 11.0, Anchor::Start, 0.0);
    svg.rect(right + 15.0, top + 30.0, 12.0, 12.0, p99c);
    svg.text(right + 32.0, top + 40.0, "p99", 11.0, Anchor::Start, 0.0);
    svg.text(
        left,
        H - 20.0,
        "post, wire: source endpoint; place, notify: destination. wire is per batch (one chunk), post -> local completion.",
        11.0,
        Anchor::Start,
        0.0,
    );
    svg.finish()
}

/// Hop ceilings (an analogy): each hop's effective bandwidth as a roof, the
/// transfer's achieved rate as a marker, per transport and concurrency at the largest size.
pub fn hop_ceiling_svg(points: &[Point]) -> String {
    let (size, group) = largest(points);
    let mut svg = Svg::new(W, H, "kvwire campaign: hop ceilings (an analogy)");
    svg.text(W / 2.0, 22.0, &format!("Hop ceilings at {} per transfer: an analogy to a roofline, not a transfer simulator", size_label(size)), 15.0, Anchor::Middle, 0.0);
    svg.text(W / 2.0, 40.0, "roof: a hop's effective bandwidth = bytes / total time in the hop; marker: the achieved rate (GB/s avg)", 11.0, Anchor::Middle, 0.0);
    let (left, right, top, bottom) = (80.0, W - 40.0, 60.0, H - 90.0);
    let rates = group.iter().flat_map(|p| p.hops.list().into_iter().filter_map(|(_, h)| h.gbps()).chain([p.gbps_avg])).filter(|v| *v > 0.0);
    let (lo, hi) = min_max(rates).unwrap_or((0.1, 10.0));
    let f = Frame { x: Scale::linear(0.0, 1.0, left, right), y: Scale::log(lo, hi, bottom, top), left, right, top, bottom };
    f.axes(&mut svg, &[], &f.y.ticks(), "", "GB/s (log scale)", &|_| String::new(), &decade_label);
    if group.is_empty() {
        empty_note(&mut svg, &f);
        return svg.finish();
    }
    let gw = (right - left) / group.len() as f64;
    let mut notes = Vec::new();
    for (g, p) in group.iter().enumerate() {
        let (x0, x1) = (left + g as f64 * gw + gw * 0.08, left + (g + 1) as f64 * gw - gw * 0.08);
        let roofs: Vec<(&str, f64)> = p.hops.list().into_iter().filter_map(|(n, h)| h.gbps().map(|r| (n, r))).collect();
        let lowest = roofs.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
        for (name, rate) in &roofs {
            let y = f.y.at(*rate);
            let bound = *rate == lowest;
            let stroke = if bound { Stroke::solid(PALETTE[1], 3.0) } else { Stroke::solid(PALETTE[0], 2.0) };
            svg.line((x0, y), (x1, y), stroke);
            svg.text(x1, y - 4.0, &format!("{name} {rate:.3} GB/s{}", if bound { " (lowest)" } else { "" }), 10.0, Anchor::End, 0.0);
        }
        // Roof labels sit above their lines at the right; the marker's label below it at the left.
        let y = f.y.at(p.gbps_avg);
        svg.circle(x0 + 10.0, y, 6.0, PALETTE[2]);
        svg.text(x0, y + 19.0, &format!("achieved {:.3} GB/s", p.gbps_avg), 10.0, Anchor::Start, 0.0);
        svg.text((x0 + x1) / 2.0, bottom + 18.0, &series_label(p), 12.0, Anchor::Middle, 0.0);
        if lowest.is_finite() && p.gbps_avg > lowest {
            notes.push(series_label(p));
        }
    }
    let mut text = String::new();
    if !notes.is_empty() {
        text = format!(
            "Above the lowest roof: {}. A hop's time can overlap other hops (wire runs from post to the ack sent after \
             placement; batches in flight and concurrent transfers overlap), so bytes / summed hop time understates it. ",
            notes.join(", ")
        );
    }
    text.push_str("An analogy, not a simulator: the lowest roof names the hop to look at first.");
    for (i, l) in wrap(&text, 150).iter().enumerate() {
        svg.text(left, H - 56.0 + i as f64 * 14.0, l, 10.0, Anchor::Start, 0.0);
    }
    svg.finish()
}

/// Splits `text` at spaces into lines of at most `width` characters (longer words stay whole).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut cur = String::new();
    for word in text.split_whitespace() {
        if !cur.is_empty() && cur.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut cur));
        }
        if !cur.is_empty() {
            cur.push(' ');
        }
        cur.push_str(word);
    }
    if !cur.is_empty() {
        lines.push(cur);
    }
    lines
}

fn min_max(vals: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    vals.filter(|v| v.is_finite()).fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

fn dedup_sorted(vals: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = vals.collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

/// Keys in first-seen order, without repeats.
fn dedup_keys(keys: impl Iterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for k in keys {
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}
