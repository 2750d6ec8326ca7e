//! The ceiling lab: `kvwire roofline` figures against hand-derived products,
//! and `kvwire report --html` from a fixture campaign written here: one
//! self-contained page whose embedded JSON is the fixture's points, whose
//! table prints each point's GB/s, and which escapes what it inserts.
//! (scripts/report-check drives the page itself in headless Chromium.)

use crate::kvwire;
use kvwire_bench::report::{self, CampaignError};
use kvwire_testkit::TempDir;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn roofline_json(args: &[&str]) -> Value {
    let mut all = vec!["roofline"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = kvwire(&all);
    assert!(out.status.success(), "{all:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Exit 2, one stderr line naming every needle, no panic.
fn assert_bad_input(args: &[&str], needles: &[&str]) -> String {
    let out = kvwire(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?}: status {:?}, stderr: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: not one line: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{args:?}: stderr lacks `{n}`: {stderr}");
    }
    stderr
}

// ------------------------------------------------------------ roofline

#[test]
fn roofline_intensity_8_at_80_is_640() {
    let v = roofline_json(&["--intensity", "8", "--bandwidth", "80"]);
    assert_eq!(v["attainable_gflops"], 8.0 * 80.0);
    assert_eq!(v["attainable_gflops"], 640.0);
    assert_eq!(v["bound"], "bandwidth-bound");
    assert!(v["peak_gflops"].is_null());
    let out = kvwire(&["roofline", "--intensity", "8", "--bandwidth", "80"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("640 GFLOP/s") && text.contains("bandwidth-bound"), "{text}");
}

#[test]
fn roofline_intensity_8_at_40_is_320() {
    let v = roofline_json(&["--intensity", "8", "--bandwidth", "40"]);
    assert_eq!(v["attainable_gflops"], 320.0);
    assert_eq!(v["bandwidth_roof_gflops"], 320.0);
    assert_eq!(v["bound"], "bandwidth-bound");
}

#[test]
fn roofline_peak_clamps_and_names_the_compute_roof() {
    // 8 × 80 = 640 > 500: the flat roof binds; ridge at 500 / 80 = 6.25.
    let v = roofline_json(&["--intensity", "8", "--bandwidth", "80", "--peak", "500"]);
    assert_eq!(v["attainable_gflops"], 500.0);
    assert_eq!(v["bandwidth_roof_gflops"], 640.0);
    assert_eq!(v["bound"], "compute-bound");
    assert_eq!(v["ridge_intensity"], 6.25);
    let out = kvwire(&["roofline", "--intensity", "8", "--bandwidth", "80", "--peak", "500"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("min(500, 640) = 500 GFLOP/s") && text.contains("compute-bound"), "{text}");
    // 8 × 40 = 320 < 500: still under the slanted roof.
    let v = roofline_json(&["--intensity", "8", "--bandwidth", "40", "--peak", "500"]);
    assert_eq!(v["attainable_gflops"], 320.0);
    assert_eq!(v["bound"], "bandwidth-bound");
    // Exactly on the ridge (8 × 62.5 = 500): the compute roof is reached.
    let v = roofline_json(&["--intensity", "8", "--bandwidth", "62.5", "--peak", "500"]);
    assert_eq!(v["attainable_gflops"], 500.0);
    assert_eq!(v["bound"], "compute-bound");
}

#[test]
fn roofline_bad_input_exits_2_naming_the_flag() {
    for bad in ["-1", "0", "abc", "inf", "NaN", ""] {
        assert_bad_input(&["roofline", "--intensity", bad, "--bandwidth", "80"], &["--intensity"]);
        assert_bad_input(&["roofline", "--intensity", "8", "--bandwidth", bad], &["--bandwidth"]);
        assert_bad_input(&["roofline", "--intensity", "8", "--bandwidth", "80", "--peak", bad], &["--peak"]);
    }
    assert_bad_input(&["roofline", "--intensity", "1e300", "--bandwidth", "1e300"], &["overflows"]);
}

#[test]
fn roofline_core_refuses_what_the_cli_refuses() {
    assert_eq!(
        report::positive("--intensity", "-2"),
        Err(report::RooflineError::NotPositive { flag: "--intensity", value: "-2".into() })
    );
    assert_eq!(report::positive("--peak", "x"), Err(report::RooflineError::NotANumber { flag: "--peak", value: "x".into() }));
    let r = report::roofline(8.0, 80.0, Some(500.0)).unwrap();
    assert_eq!((r.attainable_gflops, r.bound), (500.0, report::Bound::Compute));
}

// ------------------------------------------------------------ report

fn hop(count: u64, sum_ns: u64, bytes: u64) -> Value {
    json!({"count": count, "sum_ns": sum_ns, "p50_ns": sum_ns / count.max(1), "p99_ns": sum_ns / count.max(1) * 3 / 2, "bytes": bytes})
}

/// Five 64 MiB transfers over tcp; hop bandwidths by hand (bytes / sum_ns
/// GB/s): post 335.54432, wire 3.3554432, place 13.4217728, notify 0 bytes
/// (no roof). Lowest: wire.
fn fixture_points() -> Vec<Value> {
    let mib64 = 67_108_864u64;
    vec![
        json!({"kind":"point","transport":"tcp","size":mib64,"concurrency":1,"chunk":1_048_576,"depth":4,"iterations":5,
            "gbps_avg":2.91234,"gbps_peak":3.0456,
            "lat_ns":{"min":21_000_000,"p50":22_000_000,"p99":25_000_000,"p999":25_500_000,"max":26_000_000},
            "payload_bytes":5 * mib64,"wire_bytes":5 * mib64 + 5 * 64 * 96,
            "baselines":[{"name":"tcp socket pair (loopback)","gbps":4.5},{"name":"memcpy","gbps":11.25}],
            "hops":{"post":hop(320, 1_000_000, 5 * mib64),"wire":hop(320, 100_000_000, 5 * mib64),"place":hop(320, 25_000_000, 5 * mib64),"notify":hop(5, 50_000, 0)}}),
        json!({"kind":"point","transport":"tcp","size":65_536,"concurrency":1,"chunk":65_536,"depth":4,"iterations":5,
            "gbps_avg":0.8125,"gbps_peak":1.0,
            "lat_ns":{"min":60_000,"p50":80_000,"p99":120_000,"p999":130_000,"max":140_000},
            "payload_bytes":327_680,"wire_bytes":328_160,"baselines":[{"name":"memcpy","gbps":9.5}],
            "hops":{"post":hop(5, 20_000, 327_680),"wire":hop(5, 300_000, 327_680),"place":hop(5, 40_000, 327_680)}}),
        // A hostile transport name: must come out escaped, and must not
        // close the data <script> or fill a template placeholder.
        json!({"kind":"point","transport":"shm</script><script>alert(1)</script>&\"'{{DATA}}","size":4_194_304,"concurrency":2,"chunk":1_048_576,"depth":2,"iterations":3,
            "gbps_avg":12.0,"gbps_peak":12.5,
            "lat_ns":{"min":300_000,"p50":330_000,"p99":400_000,"p999":410_000,"max":420_000},
            "payload_bytes":12_582_912,"wire_bytes":12_582_912,"baselines":[],
            "hops":{"wire":hop(12, 1_000_000, 12_582_912)}}),
    ]
}

fn write_fixture(dir: &TempDir, points: &[Value], extra_lines: &[&str]) -> PathBuf {
    let mut text = String::new();
    text.push_str(r#"{"kind":"campaign","started":"fixture"}"#);
    text.push('\n');
    for p in points {
        text.push_str(&serde_json::to_string(p).unwrap());
        text.push('\n');
    }
    for l in extra_lines {
        text.push_str(l);
        text.push('\n');
    }
    let path = dir.join("campaign.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

fn embedded_json(page: &str) -> Value {
    let open = r#"<script type="application/json" id="kvwire-data">"#;
    let start = page.find(open).expect("page has the kvwire-data element") + open.len();
    let len = page[start..].find("</script>").expect("data element is closed");
    serde_json::from_str(&page[start..start + len]).expect("embedded data is JSON")
}

/// The text of every `<td class="n CLASS">` cell, in order.
fn cells(page: &str, class: &str) -> Vec<String> {
    let open = format!(r#"<td class="n {class}">"#);
    page.match_indices(&open).map(|(i, _)| page[i + open.len()..].split('<').next().unwrap().to_string()).collect()
}

fn report_page(from: &Path, dir: &TempDir) -> String {
    let out_path = dir.join("report.html");
    let out = kvwire(&["report", "--html", "--out", out_path.to_str().unwrap(), "--from", from.to_str().unwrap()]);
    assert!(out.status.success(), "report failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("3 points"), "{}", String::from_utf8_lossy(&out.stdout));
    std::fs::read_to_string(&out_path).expect("the page was written")
}

#[test]
fn report_from_fixture_is_one_self_contained_page() {
    let dir = TempDir::new("report-it-page");
    let from = write_fixture(&dir, &fixture_points(), &[]);
    let page = report_page(&from, &dir);
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert!(page.contains("analogy, not a transfer simulator"));
    // Nothing is fetched: the only URL on the page is the SVG namespace name
    // the script passes to createElementNS.
    let svg_ns = "http://www.w3.org/2000/svg";
    for scheme in ["http://", "https://", "//cdn", "url("] {
        for (i, _) in page.match_indices(scheme) {
            assert!(page[i..].starts_with(svg_ns), "external reference at byte {i}: {}", &page[i..(i + 60).min(page.len())]);
        }
    }
    for attr in [" src=", " href=", "<link", "@import"] {
        assert!(!page.contains(attr), "page has `{attr}`");
    }
    // Inline SVG plots and the ceiling controls are there.
    assert!(page.matches("<svg class=\"chart\"").count() >= 2 + 3, "throughput, end-to-end and one chart per hop");
    for id in ["reset", "step", "play", "in-intensity", "in-bandwidth", "ceiling", "selftest"] {
        assert!(page.contains(&format!("id=\"{id}\"")), "no #{id}");
    }
}

#[test]
fn report_embeds_the_fixture_points_and_prints_their_gbps() {
    let dir = TempDir::new("report-it-json");
    let points = fixture_points();
    let from = write_fixture(&dir, &points, &[r#"{"kind":"summary","points":3}"#]);
    let page = report_page(&from, &dir);
    let data = embedded_json(&page);
    assert_eq!(data["points"], Value::Array(points.clone()), "embedded JSON is not the fixture's points");
    // One table cell per point, in file order, printed to three decimals.
    let want_avg: Vec<String> = points.iter().map(|p| format!("{:.3}", p["gbps_avg"].as_f64().unwrap())).collect();
    let want_peak: Vec<String> = points.iter().map(|p| format!("{:.3}", p["gbps_peak"].as_f64().unwrap())).collect();
    assert_eq!(want_avg, ["2.912", "0.812", "12.000"]);
    assert_eq!(cells(&page, "gbps-avg"), want_avg);
    assert_eq!(cells(&page, "gbps-peak"), want_peak);
    // Lowest hop roof of the first point: wire, 5 × 64 MiB / 100 ms = 3.355 GB/s.
    assert!(page.contains(r#"<span class="lowest-hop">wire</span> <span class="lowest-gbps">3.355</span>"#));
    assert!(page.contains("1 × campaign") && page.contains("1 × summary"), "other kinds are counted");
}

#[test]
fn report_escapes_what_it_inserts() {
    let dir = TempDir::new("report-it-escape");
    let page = report_page(&write_fixture(&dir, &fixture_points(), &[]), &dir);
    assert!(!page.contains("<script>alert(1)"), "raw markup from the JSONL reached the page");
    assert!(page.contains("shm&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;&amp;&quot;&#39;{{DATA}}"));
    // Two scripts, the data element and the code, and nothing else.
    assert_eq!(page.matches("<script").count(), 2);
    assert_eq!(page.matches("</script>").count(), 2);
    assert_eq!(embedded_json(&page)["points"][2]["transport"], "shm</script><script>alert(1)</script>&\"'{{DATA}}");
}

#[test]
fn report_shows_each_points_model_and_a_model_error_at_the_top() {
    let dir = TempDir::new("report-it-model");
    let mut points = fixture_points();
    // The 64 MiB point's mean holds its bound; the 64 KiB point's undercuts it.
    points[0]["model"] = json!({"chunks":64,"setup_ns":0,"sequential_ns":25_300_000,"pipelined_ns":20_100_000,"lower_ns":20_000_000,
        "bounding":"wire","measured_ns":22_000_000,"overlap":0.6,"fit":{"kind":"overlap","share":0.6}});
    points[1]["model"] = json!({"chunks":1,"setup_ns":0,"sequential_ns":72_000,"pipelined_ns":72_000,"lower_ns":60_000,
        "bounding":"wire","measured_ns":50_000,"overlap":null,"fit":{"kind":"below_lower_bound","measured_ns":50_000,"lower_ns":60_000}});
    let from = write_fixture(&dir, &points, &[]);
    let page = report_page(&from, &dir);
    assert!(page.contains(r#"<td class="model">overlap 60%</td>"#), "the model's fit per point");
    assert!(page.contains(r#"<td class="model model-error">MODEL ERROR</td>"#), "the undercut bound, in its cell");
    let banner = r#"<p class="model-error">MODEL ERROR: #1 tcp 64 KiB ×1: mean latency 50000 ns is below the lower bound 60000 ns (wire per transfer)"#;
    assert!(page.contains(banner), "the undercut bound, at the top, with its numbers: {}", page.lines().filter(|l| l.contains("model-error")).collect::<Vec<_>>().join("\n"));
    assert_eq!(page.matches(r#"<p class="model-error">"#).count(), 1, "only the point that undercut its bound");
    // A campaign written before the model was kept still renders.
    assert!(page.contains(r#"<td colspan="3" class="muted">not in this campaign</td>"#), "the third point has no model");
}

#[test]
fn report_malformed_line_names_its_number() {
    let dir = TempDir::new("report-it-bad");
    // Line 1 is the campaign header, lines 2-4 the points, line 5 is cut short.
    let from = write_fixture(&dir, &fixture_points(), &[r#"{"kind":"point","transport":"tcp","size":"#]);
    let out_path = dir.join("report.html");
    let args = ["report", "--html", "--out", out_path.to_str().unwrap(), "--from", from.to_str().unwrap()];
    assert_bad_input(&args, &["line 5", "not JSON", from.to_str().unwrap()]);
    assert!(!out_path.exists(), "no page from a bad campaign");

    // A point missing a field, on line 3.
    let mut points = fixture_points();
    points[1].as_object_mut().unwrap().remove("gbps_peak");
    let from = write_fixture(&dir, &points, &[]);
    assert_bad_input(&args, &["line 3", "gbps_peak"]);

    // A line that is JSON but has no kind, on line 2.
    std::fs::write(&from, "{\"kind\":\"campaign\"}\n[1,2]\n").unwrap();
    assert_bad_input(&args, &["line 2", "kind"]);
}

#[test]
fn report_bad_arguments_exit_2() {
    let dir = TempDir::new("report-it-args");
    let from = write_fixture(&dir, &fixture_points(), &[]);
    let from = from.to_str().unwrap();
    let out = dir.join("r.html");
    assert_bad_input(&["report", "--out", out.to_str().unwrap(), "--from", from], &["--html"]);
    let nowhere = dir.join("no/such/dir/r.html");
    assert_bad_input(&["report", "--html", "--out", nowhere.to_str().unwrap(), "--from", from], &["--out", "does not exist"]);
    let missing = dir.join("absent.jsonl");
    assert_bad_input(&["report", "--html", "--out", out.to_str().unwrap(), "--from", missing.to_str().unwrap()], &["--from"]);
    std::fs::write(dir.join("empty.jsonl"), "\n{\"kind\":\"campaign\"}\n").unwrap();
    assert_bad_input(
        &["report", "--html", "--out", out.to_str().unwrap(), "--from", dir.join("empty.jsonl").to_str().unwrap()],
        &["no {\"kind\":\"point\"} lines"],
    );
}

#[test]
fn hop_roofs_are_bytes_over_time_in_transfer_order() {
    let text: String = fixture_points().iter().map(|p| serde_json::to_string(p).unwrap() + "\n").collect();
    let c = report::parse_campaign(&text).unwrap();
    let roofs = c.points[0].roofs();
    let names: Vec<&str> = roofs.iter().map(|r| r.hop.as_str()).collect();
    assert_eq!(names, ["post", "wire", "place"], "notify moved no bytes, so it is no roof");
    // 5 × 67108864 bytes over 1 ms, 100 ms and 25 ms.
    let bytes = 5.0 * 67_108_864.0;
    let want = [bytes / 1e6, bytes / 1e8, bytes / 2.5e7];
    for (r, w) in roofs.iter().zip(want) {
        assert!((r.gbps - w).abs() < 1e-9 * w, "{}: {} vs {w}", r.hop, r.gbps);
    }
    assert_eq!(c.points[0].lowest_roof().unwrap().hop, "wire");
    assert!(c.points[0].gbps_avg < c.points[0].lowest_roof().unwrap().gbps);
}

#[test]
fn staged_hops_sort_in_path_order_in_rust_and_in_the_page() {
    // The path order is the transport's own.
    let path: Vec<&str> = kvwire_transport::metrics::Hop::ALL.iter().map(|h| h.name()).collect();
    assert_eq!(report::HOP_ORDER.to_vec(), path);
    // A device-resident cache without GPUDirect adds `stage` on the source
    // and `device_complete` on the destination.
    let mib64 = 67_108_864u64;
    let mut p = fixture_points().remove(0);
    p["hops"]["stage"] = hop(40, 20_000_000, 5 * mib64);
    p["hops"]["device_complete"] = hop(20, 200_000_000, 5 * mib64);
    let c = report::parse_campaign(&serde_json::to_string(&p).unwrap()).unwrap();
    let names: Vec<String> = c.points[0].roofs().into_iter().map(|r| r.hop).collect();
    assert_eq!(names, ["stage", "post", "wire", "place", "device_complete"]);
    // 5 × 64 MiB took 200 ms host → device and 100 ms on the wire: the H2D copy bounds it.
    assert_eq!(c.points[0].lowest_roof().unwrap().hop, "device_complete");
    let dir = TempDir::new("report-it-order");
    let page = report_page(&write_fixture(&dir, &fixture_points(), &[]), &dir);
    let js = format!("var HOP_ORDER = [{}];", path.iter().map(|h| format!("\"{h}\"")).collect::<Vec<_>>().join(", "));
    assert!(page.contains(&js), "the page's hop order is not {js}");
}

#[test]
fn parse_campaign_errors_are_comparable() {
    assert_eq!(report::parse_campaign("\n\n"), Err(CampaignError::NoPoints { lines: 0 }));
    let e = report::parse_campaign("{\"kind\":\"point\"}\n\"x\"\n").unwrap_err();
    assert!(e.to_string().starts_with("line 1: bad point"), "{e}");
    assert_eq!(report::parse_campaign("{\"kind\":\"meta\"}\n7\n"), Err(CampaignError::NoKind { line: 2 }));
    let mut p = fixture_points().remove(0);
    p["gbps_avg"] = json!(-1.0);
    let e = report::parse_campaign(&serde_json::to_string(&p).unwrap()).unwrap_err();
    assert!(matches!(e, CampaignError::BadPoint { line: 1, .. }) && e.to_string().contains("gbps_avg"), "{e}");
}

#[test]
fn report_without_from_runs_the_default_campaign_and_keeps_it() {
    let dir = TempDir::new("report-it-default");
    let out_path = dir.join("r.html");
    let out = kvwire(&["report", "--html", "--out", out_path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "report without --from failed: {stderr}");
    assert!(stderr.contains("bench campaign --transports tcp,shm --sizes 64K,4M --iterations 3"), "{stderr}");
    let jsonl = std::fs::read_to_string(dir.join("r.campaign/campaign.jsonl")).expect("the campaign is kept beside the page");
    let points: Vec<Value> = jsonl
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] == "point")
        .collect();
    // tcp and shm × 64K and 4M, at least once each.
    for t in ["tcp", "shm"] {
        for size in [65_536u64, 4_194_304] {
            assert!(points.iter().any(|p| p["transport"] == t && p["size"] == size), "no {t} {size} point in {jsonl}");
        }
    }
    let page = std::fs::read_to_string(&out_path).unwrap();
    assert_eq!(embedded_json(&page)["points"], Value::Array(points));
}
