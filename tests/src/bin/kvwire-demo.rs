//! The demo's client side: prefill and decode clients of two running
//! kvwired daemons. Prints the inventory, the plan summary, each layer's
//! readiness, the per-hop table with the hop that bounded the transfer, and
//! the logit comparison. Exit 1 when the logits differ.

use kvwire_e2e::scenario::{self, Scenario};
use kvwired::client::Client;
use std::path::PathBuf;
use std::process::ExitCode;

fn arg(args: &[String], key: &str) -> Option<String> {
    args.iter().position(|a| a == key).and_then(|i| args.get(i + 1)).cloned()
}

fn hop_table(text: &str) -> Vec<(String, u64, f64, u64)> {
    // (hop, count, seconds, bytes) from the Prometheus text.
    let mut rows: Vec<(String, u64, f64, u64)> = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let Some(hop) = name.split("hop=\"").nth(1).and_then(|r| r.split('"').next()) else { continue };
        let row = match rows.iter_mut().position(|r| r.0 == hop) {
            Some(i) => &mut rows[i],
            None => {
                rows.push((hop.to_string(), 0, 0.0, 0));
                rows.last_mut().expect("just pushed")
            }
        };
        if name.starts_with("kvwire_hop_seconds_count") {
            row.1 = value.parse().unwrap_or(0);
        } else if name.starts_with("kvwire_hop_seconds_sum") {
            row.2 = value.parse().unwrap_or(0.0);
        } else if name.starts_with("kvwire_hop_bytes_total") {
            row.3 = value.parse().unwrap_or(0);
        }
    }
    rows
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(a), Some(b)) = (arg(&args, "--a"), arg(&args, "--b")) else {
        eprintln!("usage: kvwire-demo --a SOCKET --b SOCKET [--peer NAME] [--tokens N] [--src LAYOUT] [--dst LAYOUT]");
        return ExitCode::from(2);
    };
    let peer = arg(&args, "--peer").unwrap_or_else(|| "decode-host".into());
    let mut sc = Scenario::new("demo");
    if let Some(t) = arg(&args, "--tokens") {
        sc.tokens = t.parse().unwrap_or(sc.tokens);
    }
    if let Some(l) = arg(&args, "--src") {
        sc.src_layout = l;
    }
    if let Some(l) = arg(&args, "--dst") {
        sc.dst_layout = l;
    }
    let ca = match Client::connect(&PathBuf::from(&a), "demo-prefill") {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvwire-demo: prefill daemon at {a}: {e:#}");
            return ExitCode::from(1);
        }
    };
    let cb = match Client::connect(&PathBuf::from(&b), "demo-decode") {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvwire-demo: decode daemon at {b}: {e:#}");
            return ExitCode::from(1);
        }
    };
    let out = match scenario::run(&ca, &cb, &peer, &sc) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("kvwire-demo: {e:#}");
            return ExitCode::from(1);
        }
    };
    let inv = &out.inventory;
    println!("model tinylm (4 layers, 8 query heads, 4 KV heads, head_dim 32), seeded weights + LoRA adapter");
    println!("cache: format {}  tokens {}  payload_bytes {}  per_token_bytes {}", inv.format, inv.tokens, inv.payload_bytes, inv.per_token_bytes.unwrap_or(0));
    println!("plan: {} -> {}", sc.src_layout, sc.dst_layout);
    println!(
        "  segments {}  bytes moved {}  reused {}",
        out.source.segments, out.source.bytes, out.destination.reused_bytes
    );
    for (l, t) in out.layer_ready.iter().enumerate() {
        println!("  layer_ready({l}) seen at {:>9.3} ms after submit", t.as_secs_f64() * 1e3);
    }
    println!("  decoder_usable seen at {:>9.3} ms after submit", out.end_to_end.as_secs_f64() * 1e3);
    println!();
    println!("{:<8} {:<8} {:>7} {:>12} {:>12} {:>10}", "daemon", "hop", "count", "total ms", "bytes", "GB/s");
    let mut bound: Option<(String, f64)> = None;
    for (who, c) in [("prefill", &ca), ("decode", &cb)] {
        let Ok(text) = c.stats() else { continue };
        for (hop, count, secs, bytes) in hop_table(&text) {
            if count == 0 {
                continue;
            }
            let gbps = if secs > 0.0 && bytes > 0 { bytes as f64 / secs / 1e9 } else { 0.0 };
            println!("{who:<8} {hop:<8} {count:>7} {:>12.3} {bytes:>12} {gbps:>10.3}", secs * 1e3);
            // `notify` runs after the flag; it waits, it does not bound.
            if hop != "notify" && bound.as_ref().is_none_or(|b| secs > b.1) {
                bound = Some((format!("{hop} ({who})"), secs));
            }
        }
    }
    if let Some((hop, secs)) = bound {
        println!("bounding hop: {hop}, {:.3} ms of {:.3} ms end to end", secs * 1e3, out.end_to_end.as_secs_f64() * 1e3);
    }
    println!();
    if out.bitwise() {
        println!("logits: bitwise identical to the local computation ({} values)", out.local.len());
        ExitCode::SUCCESS
    } else {
        println!("logits: DIFFER from the local computation, max abs diff {}", out.max_abs_diff());
        ExitCode::from(1)
    }
}
