//! `kvwire stats` against one real kvwired, over its metrics endpoint and its
//! control socket; its failures; and the Prometheus text parser on a
//! hand-written sample whose figures are derived by hand.

use crate::kvwire;
use kvwire_client::promtext::{self, LatencyFrom, ParseError, Stats};
use kvwire_testkit::{free_addr, start_daemon, DaemonProc, TempDir};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

const HOPS: [&str; 9] = ["pack", "stage", "post", "wire", "place", "device_complete", "unpack", "verify", "notify"];

/// A kvwired with a metrics endpoint. Field order is drop order: the
/// daemon dies before its directory goes.
struct Daemon {
    proc: DaemonProc,
    metrics: String,
    _dir: TempDir,
}

/// Starts node `stats-TAG`, serving metrics on a free loopback port.
fn start(tag: &str) -> Daemon {
    let dir = TempDir::new(&format!("stats-{tag}"));
    let metrics = free_addr();
    let proc = start_daemon(dir.path(), &format!("stats-{tag}"), "a-secret-of-at-least-16-bytes", &[], &format!("metrics_listen = \"{metrics}\"\n"));
    Daemon { proc, metrics, _dir: dir }
}

fn stats_json(args: &[&str]) -> Value {
    let out = kvwire(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// Exit `code`, one stderr line containing every needle.
fn assert_fails(args: &[&str], code: i32, needles: &[&str]) {
    let out = kvwire(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{args:?}: status {:?}, stderr: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: not one line: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{args:?}: stderr lacks `{n}`: {stderr}");
    }
}

fn refused_peers(v: &Value) -> u64 {
    v["refused"].as_array().unwrap().iter().find(|r| r["who"] == "peer").unwrap()["count"].as_u64().unwrap()
}

/// The checks both sources must pass on a fresh daemon with one refused peer.
fn check_fresh(v: &Value, node: &str, source: &str) {
    assert_eq!(v["node"], node, "{v:#}");
    assert_eq!(v["source"], source, "{v:#}");
    for k in ["payload_bytes", "wire_bytes", "reused_bytes", "retransmitted_bytes", "compressed_bytes", "received_bytes"] {
        assert_eq!(v["counters"][k], 0, "{k}: {v:#}");
    }
    let transfers: Vec<(String, String, u64)> = v["transfers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["role"].as_str().unwrap().into(), t["outcome"].as_str().unwrap().into(), t["count"].as_u64().unwrap()))
        .collect();
    let want: Vec<(String, String, u64)> = [("source", "done"), ("source", "failed"), ("destination", "done"), ("destination", "failed"), ("any", "cancelled")]
        .iter()
        .map(|(r, o)| (r.to_string(), o.to_string(), 0))
        .collect();
    assert_eq!(transfers, want);
    assert_eq!(refused_peers(v), 1, "{v:#}");
    assert_eq!(v["refused"].as_array().unwrap().iter().find(|r| r["who"] == "client").unwrap()["count"], 0);
    let hops: Vec<&str> = v["hops"].as_array().unwrap().iter().map(|h| h["hop"].as_str().unwrap()).collect();
    assert_eq!(hops, HOPS);
    for h in v["hops"].as_array().unwrap() {
        assert_eq!(h["count"], 0, "{h}");
        assert_eq!(h["bytes"], 0, "{h}");
        assert_eq!(h["sum_seconds"], 0.0, "{h}");
        assert_eq!(h["latency_from"], "buckets", "{h}");
        for k in ["p50_seconds", "p90_seconds", "p99_seconds", "p999_seconds", "max_seconds", "mean_seconds", "bandwidth_bytes_per_second"] {
            assert!(h[k].is_null(), "{k} without samples: {h}");
        }
    }
}

#[test]
fn stats_over_metrics_endpoint_and_control_socket_agree() {
    let d = start("live");
    // One refused peer: connect to the peer port and hang up mid-handshake.
    drop(std::net::TcpStream::connect(&d.proc.peer).unwrap());
    let url = format!("http://{}/metrics", d.metrics);
    let deadline = Instant::now() + Duration::from_secs(10);
    let via_http = loop {
        let v = stats_json(&["stats", "--metrics", &d.metrics, "--json"]);
        if refused_peers(&v) == 1 || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    check_fresh(&via_http, "stats-live", &url);
    let sock = d.proc.socket.to_str().unwrap();
    let via_socket = stats_json(&["stats", "--socket", sock, "--json"]);
    check_fresh(&via_socket, "stats-live", &format!("unix:{sock}"));

    // The table: counters, then one row per hop.
    let out = kvwire(&["stats", "--metrics", &d.metrics]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.starts_with(&format!("node stats-live  from {url}")), "{table}");
    for row in ["payload_bytes", "retransmitted_bytes", "compressed_bytes", "transfers role=source outcome=done", "refused peer"] {
        assert!(table.contains(row), "table lacks {row}:\n{table}");
    }
    let refused = table.lines().find(|l| l.starts_with("refused peer")).unwrap();
    assert_eq!(refused.split_whitespace().last(), Some("1"), "{refused}");
    for hop in HOPS {
        assert!(table.lines().any(|l| l.split_whitespace().next() == Some(hop)), "table lacks hop {hop}:\n{table}");
    }
    assert!(table.contains("quantiles: the daemon's hdrhistogram"), "{table}");
    let header = table.lines().find(|l| l.starts_with("hop ")).unwrap();
    assert_eq!(header.split_whitespace().collect::<Vec<_>>(), ["hop", "count", "p50", "p90", "p99", "p99.9", "max", "mean", "from", "bytes", "bandwidth"]);
}

#[test]
fn stats_refuses_unreachable_daemons_and_bad_arguments() {
    // Nothing listens on a port just freed.
    let addr = free_addr();
    assert_fails(&["stats", "--metrics", &addr], 1, &["cannot connect", &addr]);
    let missing = std::env::temp_dir().join(format!("kvwire-stats-no-such-{}.sock", std::process::id()));
    assert_fails(&["stats", "--socket", missing.to_str().unwrap(), "--json"], 1, &["control socket", missing.to_str().unwrap()]);
    assert_fails(&["stats", "--metrics", "no-port-here"], 2, &["HOST:PORT"]);
    let out = kvwire(&["stats"]);
    assert_eq!(out.status.code(), Some(2), "neither --metrics nor --socket");
    let out = kvwire(&["stats", "--metrics", &addr, "--socket", "/x"]);
    assert_eq!(out.status.code(), Some(2), "both --metrics and --socket");
}

/// A one-shot HTTP server answering `response` to the first request.
fn serve_once(response: &'static str) -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 1024];
        let _ = s.read(&mut buf);
        let _ = s.write_all(response.as_bytes());
    });
    (addr, h)
}

#[test]
fn stats_refuses_bad_metrics_text_and_non_200_answers() {
    let (addr, h) = serve_once("HTTP/1.1 200 OK\r\nContent-Length: 28\r\nConnection: close\r\n\r\nkvwire_payload_bytes_total{\n");
    assert_fails(&["stats", "--metrics", &addr], 1, &["line 1", &addr]);
    h.join().unwrap();
    let (addr, h) = serve_once("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nsome_other_metric 1\n");
    assert_fails(&["stats", "--metrics", &addr, "--json"], 1, &["kvwire_payload_bytes_total", &addr]);
    h.join().unwrap();
    let (addr, h) = serve_once("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
    assert_fails(&["stats", "--metrics", &addr], 1, &["404", &addr]);
    h.join().unwrap();
}

#[test]
fn stats_reads_a_chunked_answer() {
    let body = SAMPLE;
    let chunked: String = body.as_bytes().chunks(100).map(|c| format!("{:x}\r\n{}\r\n", c.len(), std::str::from_utf8(c).unwrap())).collect();
    let resp: &'static str = Box::leak(format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{chunked}0\r\n\r\n").into_boxed_str());
    let (addr, h) = serve_once(resp);
    let v = stats_json(&["stats", "--metrics", &addr, "--json"]);
    h.join().unwrap();
    assert_eq!(v["node"], "a");
    assert_eq!(v["counters"]["payload_bytes"], 4096);
    // The table lists the reasons writes were refused for, and only those.
    let (addr, h) = serve_once(resp);
    let out = kvwire(&["stats", "--metrics", &addr]);
    h.join().unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.lines().any(|l| l.starts_with("writes refused unknown_key") && l.ends_with(" 60")), "{table}");
    assert!(!table.contains("out_of_bounds"), "{table}");
}

// ------------------------------------------------------------ promtext

/// The shape kvwired renders, with hand-picked figures.
const SAMPLE: &str = r#"# HELP kvwire_payload_bytes_total Payload bytes.
# TYPE kvwire_payload_bytes_total counter
kvwire_payload_bytes_total{node="a"} 4096
kvwire_wire_bytes_total{node="a"} 4200
kvwire_reused_bytes_total{node="a"} 1024
kvwire_retransmitted_bytes_total{node="a"} 0
kvwire_received_bytes_total{node="a"} 7
# TYPE kvwire_transfers_total counter
kvwire_transfers_total{node="a",role="source",outcome="done"} 3
kvwire_transfers_total{node="a",role="source",outcome="failed"} 1
kvwire_transfers_total{node="a",role="any",outcome="cancelled"} 2
kvwire_refused_total{node="a",who="peer"} 5
kvwire_refused_total{node="a",who="client"} 0
kvwire_writes_refused_total{node="a",reason="unknown_key"} 60
kvwire_writes_refused_total{node="a",reason="out_of_bounds"} 0
kvwire_starts_total{node="a",how="announced"} 0
kvwire_starts_total{node="a",how="claimed"} 2
kvwire_starts_total{node="a",how="offered"} 1
kvwire_peer_connections_total{node="a",how="opened"} 1
kvwire_peer_connections_total{node="a",how="reused"} 2
kvwire_data_connections_total{node="a",how="opened"} 4
kvwire_data_connections_total{node="a",how="reused"} 8
# TYPE kvwire_hop_seconds histogram
kvwire_hop_seconds_bucket{node="a",hop="wire",le="0.001"} 2
kvwire_hop_seconds_bucket{node="a",hop="wire",le="0.01"} 6
kvwire_hop_seconds_bucket{node="a",hop="wire",le="0.1"} 10
kvwire_hop_seconds_bucket{node="a",hop="wire",le="+Inf"} 10
kvwire_hop_seconds_sum{node="a",hop="wire"} 0.25
kvwire_hop_seconds_count{node="a",hop="wire"} 10
kvwire_hop_bytes_total{node="a",hop="wire"} 1000000
kvwire_hop_seconds_bucket{node="a",hop="pack",le="+Inf"} 4
kvwire_hop_seconds_sum{node="a",hop="pack"} 0.002
kvwire_hop_seconds_count{node="a",hop="pack"} 4
kvwire_hop_bytes_total{node="a",hop="pack"} 0
# TYPE kvwire_device_memory gauge
kvwire_device_memory{node="a",group="g",rank="0",memory="0",path="direct",how="ibv_reg_dmabuf_mr on mlx5_0"} 1
kvwire_device_memory{node="a",group="g",rank="1",memory="0",path="staged",why="no dmabuf"} 1
"#;

fn close(a: Option<f64>, b: f64) -> bool {
    a.is_some_and(|a| (a - b).abs() < 1e-12)
}

#[test]
fn promtext_reads_counters_and_hops_from_a_sample() {
    let s = Stats::from_text(SAMPLE).unwrap();
    assert_eq!(s.node.as_deref(), Some("a"));
    assert_eq!(
        (s.counters.payload_bytes, s.counters.wire_bytes, s.counters.reused_bytes, s.counters.retransmitted_bytes, s.counters.received_bytes),
        (4096, 4200, 1024, 0, 7)
    );
    let t: Vec<_> = s.transfers.iter().map(|t| (t.role.as_str(), t.outcome.as_str(), t.count)).collect();
    assert_eq!(t, [("source", "done", 3), ("source", "failed", 1), ("any", "cancelled", 2)]);
    let r: Vec<_> = s.refused.iter().map(|r| (r.who.as_str(), r.count)).collect();
    assert_eq!(r, [("peer", 5), ("client", 0)]);
    let r: Vec<_> = s.writes_refused.iter().map(|r| (r.who.as_str(), r.count)).collect();
    assert_eq!(r, [("unknown_key", 60), ("out_of_bounds", 0)]);
    let h: Vec<_> = s.starts.iter().map(|h| (h.how.as_str(), h.count)).collect();
    assert_eq!(h, [("announced", 0), ("claimed", 2), ("offered", 1)]);
    let c: Vec<_> = s.connections.iter().map(|c| (c.kind.as_str(), c.how.as_str(), c.count)).collect();
    assert_eq!(c, [("peer", "opened", 1), ("peer", "reused", 2), ("data", "opened", 4), ("data", "reused", 8)]);
    assert_eq!(s.hops.len(), 2);

    let w = &s.hops[0];
    assert_eq!((w.hop.as_str(), w.count, w.bytes, w.latency_from), ("wire", 10, 1_000_000, LatencyFrom::Buckets));
    // Median: rank 5 of 10 lies in (0.001, 0.01], which holds ranks 3..=6:
    // 0.001 + 0.009 * (5 - 2) / 4 = 0.00775.
    assert!(close(w.p50_seconds, 0.00775), "{:?}", w.p50_seconds);
    // p99: rank 9.9 lies in (0.01, 0.1], holding ranks 7..=10: 0.01 + 0.09 * 3.9 / 4 = 0.09775.
    assert!(close(w.p99_seconds, 0.09775), "{:?}", w.p99_seconds);
    assert!(close(w.mean_seconds, 0.025));
    // 1e6 bytes over 0.25 s.
    assert!(close(w.bandwidth_bytes_per_second, 4e6));

    let p = &s.hops[1];
    assert_eq!((p.hop.as_str(), p.count, p.latency_from), ("pack", 4, LatencyFrom::Mean));
    assert_eq!((p.p50_seconds, p.p99_seconds), (None, None), "no finite buckets: no quantiles");
    assert!(close(p.mean_seconds, 0.0005));
    assert!(close(p.bandwidth_bytes_per_second, 0.0), "0 bytes over 2 ms");

    let d: Vec<_> = s.device_memory.iter().map(|d| (d.group.as_str(), d.rank, d.memory, d.path.as_str(), d.detail.as_str())).collect();
    assert_eq!(d, [("g", 0, 0, "direct", "ibv_reg_dmabuf_mr on mlx5_0"), ("g", 1, 0, "staged", "no dmabuf")]);
    let e = Stats::from_text(&SAMPLE.replace("rank=\"1\"", "rank=\"one\"")).unwrap_err();
    assert!(e.to_string().contains("`rank` is not a number"), "{e}");
}

#[test]
fn promtext_errors_name_the_line_or_the_metric() {
    let bad_line = SAMPLE.replace("kvwire_wire_bytes_total{node=\"a\"} 4200", "kvwire_wire_bytes_total{node=\"a\" 4200");
    match Stats::from_text(&bad_line).unwrap_err() {
        ParseError::Syntax { line, .. } => assert_eq!(line, 4),
        e => panic!("{e}"),
    }
    let e = Stats::from_text(&SAMPLE.replace("kvwire_received_bytes_total", "other_total")).unwrap_err();
    assert_eq!(e, ParseError::Missing { metric: "kvwire_received_bytes_total".into() });
    let e = Stats::from_text(&SAMPLE.replace("{node=\"a\"} 4096", "{node=\"a\"} 4096.5")).unwrap_err();
    assert!(matches!(&e, ParseError::Value { line: 3, metric, .. } if metric == "kvwire_payload_bytes_total"), "{e}");
    // Buckets that are not cumulative.
    let e = Stats::from_text(&SAMPLE.replace("le=\"0.01\"} 6", "le=\"0.01\"} 1")).unwrap_err();
    assert!(e.to_string().contains("not cumulative"), "{e}");
    // +Inf must equal _count.
    let e = Stats::from_text(&SAMPLE.replace("le=\"+Inf\"} 10", "le=\"+Inf\"} 9")).unwrap_err();
    assert!(e.to_string().contains("+Inf"), "{e}");
    assert!(promtext::parse("").unwrap().is_empty());
}

#[test]
fn a_connect_error_names_its_cause_once() {
    let o = crate::kvwire(&["stats", "--socket", "/nonexistent-kvwire-dir/x.sock"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert!(err.contains("/nonexistent-kvwire-dir/x.sock"), "{err}");
}
