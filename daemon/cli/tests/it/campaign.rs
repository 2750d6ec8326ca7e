//! `kvwire bench campaign` through the real binary: the table, the JSONL
//! schema with counts derived by hand from the settings, the SVG plots, and
//! exit status 2 naming the flag for bad input. No timing assertions.

use crate::kvwire;
use kvwire_testkit::TempDir;
use serde_json::Value;
use std::path::Path;

fn u(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("`{key}` is not an unsigned integer in {v}"))
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("`{key}` is not a number in {v}"))
}

/// Every `&` starts an entity; there is an svg root with lines or paths.
fn check_svg(path: &Path) {
    let doc = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let name = path.display();
    assert!(doc.starts_with("<svg"), "{name} does not start with <svg");
    assert!(doc.trim_end().ends_with("</svg>"), "{name} does not end with </svg>");
    assert!(doc.contains("xmlns=\"http://www.w3.org/2000/svg\""), "{name}: no SVG namespace");
    assert!(doc.contains("<line") || doc.contains("<path"), "{name}: no <line or <path");
    assert!(doc.contains("<text"), "{name}: no labels");
    for (i, _) in doc.match_indices('&') {
        let rest = &doc[i..];
        let entity = ["&amp;", "&lt;", "&gt;", "&quot;", "&#39;"].iter().any(|e| rest.starts_with(e));
        assert!(entity, "{name}: unescaped '&' at byte {i}: {}", &rest[..rest.len().min(30)]);
    }
    assert_eq!(doc.matches("<text").count(), doc.matches("</text>").count(), "{name}: unbalanced <text>");
    assert_eq!(doc.matches("<svg").count(), 1, "{name}: nested or repeated <svg>");
}

#[test]
fn small_campaign_writes_table_jsonl_and_plots() {
    let dir = TempDir::new("campaign-small");
    let (iters, chunk, depth) = (3u64, 256u64 << 10, 2u64);
    let out = kvwire(&[
        "bench", "campaign", "--transports", "tcp,shm", "--sizes", "4K,1M", "--iterations", "3", "--chunk", "256K", "--depth", "2",
        "--concurrency", "1,2", "--out", dir.as_str(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "status {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);

    let points: Vec<(&str, u64, &str, u64)> = ["tcp", "shm"]
        .iter()
        .flat_map(|t| [(4096u64, "4K"), (1 << 20, "1M")].into_iter().flat_map(move |(s, l)| [1u64, 2].map(|c| (*t, s, l, c))))
        .collect();
    assert_eq!(points.len(), 8);

    // The table: a header naming the columns, then one row per point.
    for col in ["transport", "size", "conc", "iters", "GB/s avg", "GB/s peak", "p50", "p99", "p99.9", "max", "ratio"] {
        assert!(stdout.contains(col), "table lacks column `{col}`:\n{stdout}");
    }
    let rows: Vec<Vec<&str>> =
        stdout.lines().filter(|l| l.starts_with("tcp ") || l.starts_with("shm ")).map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows.len(), points.len(), "one row per point:\n{stdout}");
    for (t, _, label, c) in &points {
        let found = rows.iter().any(|r| r[0] == *t && r[1] == *label && r[2] == c.to_string() && r[3] == "3");
        assert!(found, "no row for {t} {label} conc {c}:\n{stdout}");
    }
    assert!(stdout.contains("must not be subtracted"), "the contention warning is missing:\n{stdout}");

    // campaign.jsonl: one object per point, every schema field, figures from the settings.
    let text = std::fs::read_to_string(dir.join("campaign.jsonl")).unwrap();
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect();
    assert_eq!(lines.len(), points.len(), "{text}");
    for (t, size, _, c) in &points {
        let p = lines
            .iter()
            .find(|p| p["transport"] == *t && p["size"] == *size && p["concurrency"] == *c)
            .unwrap_or_else(|| panic!("no JSONL point for {t} {size} conc {c}:\n{text}"));
        let what = format!("{t} {size} conc {c}: {p}");
        assert_eq!(p["kind"], "point", "{what}");
        assert_eq!(u(p, "chunk"), chunk.min(*size), "{what}");
        assert_eq!(u(p, "depth"), depth, "{what}");
        assert_eq!(u(p, "iterations"), iters, "{what}");
        let (avg, peak) = (f(p, "gbps_avg"), f(p, "gbps_peak"));
        assert!(avg > 0.0 && avg.is_finite(), "{what}");
        assert!(peak >= avg * 0.999, "peak below average: {what}");
        let lat = &p["lat_ns"];
        let (min, p50, max) = (u(lat, "min"), u(lat, "p50"), u(lat, "max"));
        assert!(0 < min && min <= p50 && p50 <= max, "latency order: {what}");
        let transfers = c * iters;
        // A handful of transfers supports no tail percentile: null, not the max renamed.
        assert!(transfers < 100 && lat["p99"].is_null() && lat["p999"].is_null(), "{what}");
        assert_eq!(u(p, "payload_bytes"), size * transfers, "{what}");
        assert!(u(p, "wire_bytes") > u(p, "payload_bytes"), "framing missing from wire_bytes: {what}");
        let baselines = p["baselines"].as_array().unwrap_or_else(|| panic!("no baselines: {what}"));
        let names: Vec<&str> = baselines.iter().map(|b| b["name"].as_str().unwrap()).collect();
        let want: &[&str] = if *t == "tcp" { &["memcpy", "tcp socket pair"] } else { &["memcpy"] };
        assert_eq!(names, want, "{what}");
        for b in baselines {
            assert!(f(b, "gbps") > 0.0, "{what}");
        }
        // Hops: one post and one wire sample per batch (chunk), all bytes
        // through each; one notify per transfer.
        let batches = size.div_ceil(chunk) * transfers;
        let hops = &p["hops"];
        for hop in ["post", "wire", "place", "notify"] {
            let h = &hops[hop];
            for k in ["count", "sum_ns", "p50_ns", "max_ns", "bytes"] {
                assert!(h[k].is_u64(), "hop {hop} lacks {k}: {what}");
            }
            assert!(u(h, "p50_ns") <= u(h, "max_ns"), "hop {hop} p50 > max: {what}");
            match h["p99_ns"].as_u64() {
                Some(p99) => assert!(u(h, "count") >= 100 && u(h, "p50_ns") <= p99 && p99 <= u(h, "max_ns"), "hop {hop}: {what}"),
                None => assert!(h["p99_ns"].is_null() && u(h, "count") < 100, "hop {hop}: p99 missing with enough samples: {what}"),
            }
            // Every hop sample lies inside its transfer: none outlasts the slowest transfer.
            assert!(u(h, "max_ns") <= max, "hop {hop} max {} ns > transfer max {max} ns: {what}", u(h, "max_ns"));
        }
        assert_eq!(u(&hops["post"], "count"), batches, "{what}");
        assert_eq!(u(&hops["wire"], "count"), batches, "{what}");
        assert_eq!(u(&hops["notify"], "count"), transfers, "{what}");
        for hop in ["post", "wire", "place"] {
            assert_eq!(u(&hops[hop], "bytes"), size * transfers, "hop {hop}: {what}");
        }
        // Every write is placed once: at least one place sample per batch.
        assert!(u(&hops["place"], "count") >= batches, "{what}");
        // The model's order, not a time: the mean latency never undercuts
        // the lower bound, which lies below the sequential sum.
        let m = &p["model"];
        let (mean, lower, sequential) = (u(m, "measured_ns"), u(m, "lower_ns"), u(m, "sequential_ns"));
        assert_eq!(u(m, "chunks"), size.div_ceil(chunk), "{what}");
        assert!(lower <= sequential, "{what}");
        assert!(mean >= lower, "MODEL ERROR: mean {mean} ns below the lower bound {lower} ns: {what}");
        assert_ne!(m["fit"]["kind"], "below_lower_bound", "{what}");
        assert!((min..=max).contains(&mean), "the mean lies among the transfers: {what}");
    }

    for svg in ["throughput_vs_size.svg", "hop_latency.svg", "hop_ceiling.svg"] {
        check_svg(&dir.join(svg));
    }
    let ceiling = std::fs::read_to_string(dir.join("hop_ceiling.svg")).unwrap();
    assert!(ceiling.contains("analogy"), "the ceiling chart must say it is an analogy");
}

#[test]
fn json_flag_prints_the_jsonl_lines() {
    let dir = TempDir::new("campaign-json");
    let out = kvwire(&["bench", "campaign", "--transports", "shm", "--sizes", "64K", "--iterations", "1", "--concurrency", "1", "--out", dir.as_str(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let file = std::fs::read_to_string(dir.join("campaign.jsonl")).unwrap();
    assert_eq!(stdout, file, "--json prints exactly the JSONL lines");
    let v: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["kind"], "point");
    assert_eq!(v["transport"], "shm");
    assert_eq!(v["size"], 65536);
}

#[test]
fn bad_input_exits_2_naming_the_flag() {
    let dir = TempDir::new("campaign-bad");
    let cases: [(&[&str], &str); 7] = [
        (&["--sizes", "4K,0"], "--sizes"),
        (&["--transports", "tcp,udp"], "--transports"),
        (&["--depth", "0"], "--depth"),
        (&["--concurrency", "0"], "--concurrency"),
        (&["--chunk", "0"], "--chunk"),
        (&["--iterations", "0"], "--iterations"),
        (&["--sizes", "1G", "--chunk", "1"], "--chunk"),
    ];
    for (extra, flag) in cases {
        let mut args = vec!["bench", "campaign", "--out", dir.as_str()];
        args.extend_from_slice(extra);
        let out = kvwire(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: status {:?}, stderr: {stderr}", out.status);
        assert!(stderr.contains(flag), "{args:?}: stderr does not name {flag}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: not one line: {stderr}");
    }
    // Nothing was measured or written for bad input.
    assert!(!dir.join("campaign.jsonl").exists());
}

#[test]
fn layouts_sweep_runs_through_two_daemons_and_writes_jsonl() {
    let dir = TempDir::new("layouts-test");
    let out = kvwire(&[
        "bench", "layouts", "--tokens", "20", "--pairs", "tp=2>tp=1,layout=hnd,block=32", "--iterations", "1", "--json", "--out", dir.as_str(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(dir.join("layouts.jsonl")).unwrap();
    let p: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(p["kind"], "layout_point");
    // llama-3.1-8b bf16: 32 layers x 8 KV heads x 128 x 2 (K,V) x 2 bytes per token.
    assert_eq!(p["payload_bytes"], 32 * 8 * 128 * 2 * 2 * 20);
    assert!(p["gbps"].as_f64().unwrap() > 0.0 && p["baseline_gbps"].as_f64().unwrap() > 0.0, "{p}");
    assert!(p["bounding"].is_string(), "{p}");
    let bad = kvwire(&["bench", "layouts", "--pairs", "tp=3"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--pairs"));
}

#[test]
fn bench_peers_refuses_bad_sizes_and_settings_by_flag() {
    for (args, flag) in [
        (&["bench", "peers", "--sizes", "1000"][..], "--sizes"),
        (&["bench", "peers", "--sizes", "1G"][..], "--sizes"),
        (&["bench", "peers", "--sizes", ","][..], "--sizes"),
        (&["bench", "peers", "--seconds", "1"][..], "--seconds"),
    ] {
        let o = crate::kvwire(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
