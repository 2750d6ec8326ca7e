//! The demo's client side: prefill and decode clients of two running
//! kvwired daemons. Prints the inventory, the plan summary, each layer's
//! readiness, the per-hop table with the hop that bounded the transfer, and
//! the logit comparison. Exit 1 when the logits differ. With `--device`
//! both caches are device-resident on the daemons' stand-in backend, and
//! the staged pipeline (device → host → wire → device) is modelled too.

use kvwire_core::timing::Fit;
use kvwire_e2e::scenario::{self, Scenario};
use kvwire_client::client::Client;
use std::path::PathBuf;
use std::process::ExitCode;

fn arg(args: &[String], key: &str) -> Option<String> {
    args.iter().position(|a| a == key).and_then(|i| args.get(i + 1)).cloned()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(a), Some(b)) = (arg(&args, "--a"), arg(&args, "--b")) else {
        eprintln!("usage: kvwire-demo --a SOCKET --b SOCKET [--peer NAME] [--tokens N] [--src LAYOUT] [--dst LAYOUT] [--device]");
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
    let device = args.iter().any(|a| a == "--device");
    if device {
        sc.memory = scenario::Memory::StandIn;
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
    let (stages, p) = scenario::timing(&out, 4);
    println!("per-hop busy time of this transfer (each side on its own daemon's clock; occupancy = busy / end to end):");
    println!("  {:<12} {:<15} {:>10} {:>12} {:>10} {:>10}", "side", "hop", "busy ms", "bytes", "GB/s", "occupancy");
    let e2e = out.end_to_end.as_nanos().max(1) as f64;
    for (side, st) in &stages {
        let occ = st.total_ns as f64 / e2e * 100.0;
        println!("  {side:<12} {:<15} {:>10.3} {:>12} {:>10.3} {:>9.0}%", st.hop, st.total_ns as f64 / 1e6, st.bytes, st.gbps(), occ);
        // Ranks that worked on the hop at once: the row above is the union
        // of their intervals (wall time); each rank's own figure beside it.
        let status = if *side == "source" { &out.source } else { &out.destination };
        for r in status.hops.iter().filter(|h| h.hop == st.hop).flat_map(|h| &h.ranks) {
            println!("  {:<12} {:<15} {:>10.3} {:>12}", "", format!("  rank {}", r.rank), r.ns as f64 / 1e6, r.bytes);
        }
    }
    println!("  (a hop several ranks worked on at once counts the union of their intervals; `rank` rows are each rank's own busy time)");
    let ms = |ns: u64| ns as f64 / 1e6;
    println!("timing model over {} layer chunks, setup {:.3} ms:", p.chunks, ms(p.setup_ns));
    println!("  sequential prediction  {:>9.3} ms", ms(p.sequential_ns));
    println!("  pipelined estimate     {:>9.3} ms  (fill, drain, equal chunks)", ms(p.pipelined_ns));
    println!("  lower bound            {:>9.3} ms  (setup + the slowest hop's busy time; the wire as the destination saw layers 0..last arrive)", ms(p.lower_ns));
    let fit = match p.fit {
        Some(Fit::Overlap { share }) => format!("{:.0}% of the possible overlap", share * 100.0),
        Some(Fit::AboveSequential { measured_ns, sequential_ns }) => {
            format!("above the sequential prediction: {:.3} ms outside every timed hop", ms(measured_ns - sequential_ns))
        }
        Some(Fit::BelowEstimate { .. }) => "faster than the equal-chunk estimate, above the lower bound".into(),
        Some(Fit::BelowLowerBound { .. }) => "BELOW the lower bound, see below".into(),
        None => "n/a".into(),
    };
    println!("  measured end to end    {:>9.3} ms  (client clock, submit -> decoder_usable seen; {fit})", ms(p.measured_ns.unwrap_or(0)));
    if let Some(Fit::BelowLowerBound { measured_ns, lower_ns }) = p.fit {
        // The bound is wrong, not the clock: say so where nobody can miss it.
        let msg = format!(
            "MODEL ERROR: measured {:.3} ms is below the lower bound {:.3} ms (by {:.3} ms): the model counts time that did not run serially",
            ms(measured_ns),
            ms(lower_ns),
            ms(lower_ns - measured_ns)
        );
        println!("  {msg}");
        eprintln!("kvwire-demo: {msg}");
    }
    if let Some(b) = &p.bounding {
        println!("  bounding hop: {b}");
    }
    let lo = scenario::layer_overlap(&out);
    println!(
        "layer-wise model, against the prefill's measured compute ({:.3} ms per layer) and each hop's busy time per layer: {:.3} of {:.3} ms of transfer would hide under compute; {:.3} ms stays on the critical path after the last layer",
        out.prefill.as_secs_f64() * 1e3 / 4.0,
        ms(lo.overlapped_ns),
        ms(lo.transfer_ns),
        ms(lo.tail_ns)
    );
    let mut streamed_ok = true;
    if device {
        let in_place = device_paths(&ca, &cb);
        match in_place {
            // Its writes did not wait for the copies: no staged pipeline ran.
            true => println!("staged model: not what ran (the source's device memory was read in place)"),
            false => staged_model(&stages, out.source.bytes, p.setup_ns),
        }
        source_marks(&out.source, in_place);
    } else {
        // The same request again, streamed for real: submitted first, then
        // each layer written and announced as the prefill computes it.
        let mut st = sc.clone();
        st.name = "demo-stream".into();
        st.stream = true;
        match scenario::run(&ca, &cb, &peer, &st) {
            Ok(o) => {
                streamed_ok = o.bitwise();
                println!(
                    "layer-wise, streamed for real (submit, then the prefill writes and announces each layer): {:.3} ms from the last layer written to decoder_usable seen (predicted above: {:.3} ms; moved whole after the prefill: {:.3} ms); logits {}",
                    o.after_last_layer.as_secs_f64() * 1e3,
                    ms(lo.tail_ns),
                    out.after_last_layer.as_secs_f64() * 1e3,
                    if streamed_ok { "bitwise identical" } else { "DIFFER" }
                );
            }
            Err(e) => {
                streamed_ok = false;
                println!("layer-wise, streamed for real: FAILED: {e:#}");
            }
        }
    }
    println!("rails of this transfer (source side; GB/s = bytes / busy):");
    for r in &out.source.rails {
        let gbps = if r.busy_ns > 0 { r.bytes as f64 / r.busy_ns as f64 } else { 0.0 };
        let failed = r.failed.as_deref().map(|f| format!("  FAILED: {f}")).unwrap_or_default();
        println!("  {:<8} {:<22} {:>10} bytes {:>5} slices {:>8.3} GB/s  re-sent {} bytes{failed}", r.name, r.addr, r.bytes, r.slices, gbps, r.retransmitted_bytes);
    }
    println!("retransmitted_bytes {}", out.source.retransmitted_bytes);
    println!();
    if out.bitwise() && streamed_ok {
        println!("logits: bitwise identical to the local computation ({} values)", out.local.len());
        ExitCode::SUCCESS
    } else {
        println!("logits: DIFFER from the local computation, max abs diff {}", out.max_abs_diff());
        ExitCode::from(1)
    }
}

/// A device-resident source's lifetime as its daemon marked it: its first
/// write; per layer, its device → host copies into a ring slot started and
/// completed, and its writes from there completed; and its release.
/// Through the ring, the first write goes out before the last copy, and
/// the release comes with the last copy, before the last writes end. Read
/// in place (`in_place`), the release comes after the last writes.
fn source_marks(st: &kvwire_client::control::TransferStatus, in_place: bool) {
    let at = |name: &str| st.marks.iter().find(|m| m.name == name).map(|m| m.at_ns as f64 / 1e6);
    let ms = |t: Option<f64>| t.map_or("(not marked)".into(), |t| format!("{t:>9.3}"));
    let staged: Vec<(usize, f64)> = (0..).map_while(|l| at(&format!("host_staged({l})")).map(|t| (l, t))).collect();
    println!("source lifetime (prefill daemon's clock, ms after its submit):");
    println!("  {:<40} {}", "first post", ms(at("posting")));
    println!("  {:<40} {:>9} {:>9} {:>9}", "layer: device -> host copies", "started", "complete", "sent");
    for (l, t) in &staged {
        println!("  {:<40} {} {} {}", format!("layer {l}"), ms(at(&format!("staging({l})"))), ms(Some(*t)), ms(at(&format!("sent({l})"))));
    }
    println!("  {:<40} {}", "source_released", ms(at("source_released")));
    let order = |what: &str, a: Option<f64>, b: Option<f64>, than: &str| match (a, b) {
        (Some(a), Some(b)) => println!("  {what} {} {than} ({:.3} ms {})", if a < b { "before" } else { "NOT before" }, (b - a).abs(), if a < b { "earlier" } else { "later" }),
        _ => println!("  {what} or {than}: marks missing"),
    };
    let last = staged.last().map(|&(l, t)| (l, t));
    order("first post", at("posting"), last.map(|(_, t)| t), "the last device -> host copy completed");
    let last_sent = last.and_then(|(l, _)| at(&format!("sent({l})")));
    match (in_place, at("source_released"), last_sent) {
        // Read in place, the NIC reads the engine's memory until the last writes complete.
        (true, Some(r), Some(s)) if r >= s => println!("  source_released after the last layer's writes completed ({:.3} ms later): the NIC read device memory in place until then", r - s),
        (true, ..) => println!("  source_released NOT after the last layer's writes completed, though the NIC read device memory in place"),
        (false, ..) => order("source_released", at("source_released"), last_sent, "the last layer's writes completed"),
    }
    println!("  staging ring: {} bytes of pinned host memory for a {}-byte transfer", st.staging_bytes, st.bytes);
    println!("  read in place by the NIC: {} of {} payload bytes (the rest gathered in the ring)", st.in_place_bytes, st.compressed_bytes);
}

/// How each daemon reads its device allocations at the source, as it
/// reports them (`kvwire_device_memory`): in place by the NIC (GPUDirect)
/// or through the staging ring, and why. Returns whether the prefill
/// daemon reads all of its in place.
fn device_paths(ca: &Client, cb: &Client) -> bool {
    println!("device memory at the source (each daemon's kvwire_device_memory):");
    let mut in_place = false;
    for (who, c) in [("prefill", ca), ("decode", cb)] {
        let stats = c.stats().map_err(|e| e.to_string()).and_then(|t| kvwire_client::promtext::Stats::from_text(&t).map_err(|e| e.to_string()));
        let memories = match stats {
            Ok(s) => s.device_memory,
            Err(e) => {
                println!("  {who:<8} no stats: {e}");
                continue;
            }
        };
        let mut paths: Vec<String> = Vec::new();
        for m in memories {
            let detail = if m.path == "direct" { format!("read in place by the NIC: {}", m.detail) } else { format!("staged through the ring: {}", m.detail) };
            if !paths.contains(&detail) {
                paths.push(detail);
            }
        }
        if who == "prefill" {
            in_place = !paths.is_empty() && paths.iter().all(|d| d.starts_with("read in place"));
        }
        for d in paths {
            println!("  {who:<8} {d}");
        }
    }
    in_place
}

/// The measured stage, wire and device_complete rates through a staging
/// ring of layer-sized chunks and two slots: what pipelining the device
/// copies with the wire would give, next to doing them in turn.
fn staged_model(stages: &[(&'static str, kvwire_core::timing::Stage)], bytes: u64, setup_ns: u64) {
    use kvwire_core::timing::{staged, HopRate, Ring};
    let rate = |side: &str, hop: &str| stages.iter().find(|(s, st)| *s == side && st.hop == hop).and_then(|(_, st)| HopRate::from_stage(st));
    let hops: Option<Vec<HopRate>> = [("source", "stage"), ("source", "wire"), ("destination", "device_complete")].iter().map(|(s, h)| rate(s, h)).collect();
    let Some(hops) = hops else {
        println!("staged model: a device hop moved nothing");
        return;
    };
    let ring = Ring { chunk: bytes.div_ceil(4).max(1), slots: 2 };
    match staged(&hops, ring, bytes, setup_ns) {
        Ok(m) => {
            let ms = |ns: u64| ns as f64 / 1e6;
            let p = &m.prediction;
            println!("staged model (device -> host -> wire -> device, {} chunks of {} bytes, {} ring slots):", p.chunks, ring.chunk, ring.slots);
            println!("  one after another      {:>9.3} ms", ms(p.sequential_ns));
            println!("  pipelined              {:>9.3} ms", ms(p.pipelined_ns));
            if let Some(b) = &p.bounding {
                println!("  bounding hop: {b}");
            }
        }
        Err(e) => println!("staged model: {e}"),
    }
}
