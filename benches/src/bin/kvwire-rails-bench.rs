//! Striping bench: one rail against two, in the same run.
//!
//! Two network namespaces are joined by two veth pairs, each shaped at the
//! sending side to the same rate (`--rate`, tc syntax). In the receiving
//! namespace run two destination daemons: `one-rail` listens on the first
//! pair only, `two-rails` on both. One source daemon moves the same cache
//! to each, alternating, `--rounds` times; every transfer is checked byte
//! for byte. Printed: the median throughput of each, the link rate as the
//! baseline, and the ratio two-rails / one-rail (ideal: 2.0). Exits 1 when a
//! transfer fails or its bytes differ, 2 on bad arguments, 3 when network
//! namespaces cannot be made (not root). Needs root and iproute2.

use kvwire_core::reuse::CacheIdentity;
use kvwire_testkit::netns::{self, Link};
use kvwire_testkit::{start_daemon_in, DaemonProc, TempDir};
use kvwire_transport::HostMem;
use kvwire_client::client::Client;
use kvwire_client::control::*;
use std::process::ExitCode;
use std::time::{Duration, Instant};

const SECRET: &str = "kvwire-rails-bench-secret-0123456789";
const USAGE: &str = "usage: kvwire-rails-bench [--rate 200mbit] [--mib 64] [--rounds 3]";

struct Args {
    rate: String,
    mib: u64,
    rounds: u32,
}

fn args() -> Result<Args, String> {
    let mut a = Args { rate: "200mbit".into(), mib: 64, rounds: 3 };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--rate" => a.rate = v()?,
            "--mib" => a.mib = v()?.parse().map_err(|e| format!("--mib: {e}"))?,
            "--rounds" => a.rounds = v()?.parse().map_err(|e| format!("--rounds: {e}"))?,
            _ => return Err(format!("unknown argument {k}")),
        }
    }
    if a.mib == 0 || a.mib % 4 != 0 || a.rounds == 0 {
        return Err("--mib must be a positive multiple of 4, --rounds positive".into());
    }
    Ok(a)
}

/// fp32, 8 layers, 8 KV heads × 128: 64 KiB per block of 16 tokens, K and V.
fn spec() -> &'static str {
    "name = \"bench\"\ndtype = \"fp32\"\n[[layers]]\nrepeat = 8\nattention = \"dense\"\nkv_heads = 8\nhead_dim = 128\n"
}

fn register(c: &Client, group: &str, blocks: u32, mem: &HostMem) -> Result<(), String> {
    let identity = CacheIdentity {
        model_digest: "bench".into(),
        adapter_digest: String::new(),
        format: "fp32/v1".into(),
        tenant: "t".into(),
        rope: "theta=10000".into(),
        position_offset: 0,
    };
    let r = RegisterCache {
        group: group.into(),
        model: ModelSource::Toml(spec().into()),
        format: "fp32".into(),
        layout: "tp=1,block=16".into(),
        rank: 0,
        num_blocks: blocks,
        identity,
    };
    c.register(r, mem).map(|_| ()).map_err(|e| format!("register {group}: {e}"))
}

/// One transfer to `peer`; returns its seconds (submit to `decoder_usable`).
fn transfer(src: &Client, dst: &Client, peer: &str, blocks: u32, request: &str) -> Result<(f64, Vec<RailUse>), String> {
    let tokens = u64::from(blocks) * 16;
    let table: Vec<u32> = (0..blocks).collect();
    let slot = dst
        .prepare(PrepareReceive { group: "dst".into(), request: request.into(), block_table: table.clone(), tokens, prefix_tokens: 0, source: None })
        .map_err(|e| format!("prepare: {e}"))?;
    let t = Instant::now();
    let sslot = src
        .submit(Submit {
            request: request.into(),
            group: "src".into(),
            block_table: table,
            tokens,
            peer: peer.into(),
            dst_group: "dst".into(),
            dst_request: request.into(),
            codec: None,
            stream: false,
        })
        .map_err(|e| format!("submit: {e}"))?
        .slot;
    dst.wait(slot, FlagName::DecoderUsable, Duration::from_secs(300)).map_err(|e| format!("{peer}: {e}"))?;
    let secs = t.elapsed().as_secs_f64();
    src.wait(sslot, FlagName::SourceReleased, Duration::from_secs(30)).map_err(|e| format!("{peer}: {e}"))?;
    Ok((secs, src.status(sslot).map_err(|e| e.to_string())?.rails))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run(a: &Args) -> Result<(), String> {
    let link = Link::new("rbench")?;
    let second = link.second_pair()?;
    for h in [&link.b, &second.1] {
        h.shape(&a.rate)?;
    }
    // Declared before the daemons, so removed after they die.
    let tmp = TempDir::try_new("rails-bench")?;
    let dir = tmp.path();
    let ns = Some(link.a.name.as_str());
    let one: DaemonProc = start_daemon_in(ns, &link.a.ip, dir, "one-rail", SECRET, &[], "");
    let rails = format!("[[rails]]\nname = \"rail1\"\ntcp_listen = \"{}:0\"\n", second.0.ip);
    let two: DaemonProc = start_daemon_in(ns, &link.a.ip, dir, "two-rails", SECRET, &[], &rails);
    let src_d = start_daemon_in(Some(&link.b.name), &link.b.ip, dir, "source", SECRET, &[("one-rail", &one.peer), ("two-rails", &two.peer)], "");
    let bytes = a.mib << 20;
    let blocks = (bytes / (16 * 2 * 8 * 8 * 128 * 4)) as u32;
    let pattern: Vec<u8> = (0..bytes).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let src_mem = HostMem::new("src", bytes).map_err(|e| e.to_string())?;
    src_mem.write(0, &pattern).map_err(|e| e.to_string())?;
    let src = Client::connect(&src_d.socket, "bench").map_err(|e| e.to_string())?;
    register(&src, "src", blocks, &src_mem)?;
    let mut dsts = Vec::new();
    for d in [&one, &two] {
        let c = Client::connect(&d.socket, "bench").map_err(|e| e.to_string())?;
        let m = HostMem::new("dst", bytes).map_err(|e| e.to_string())?;
        register(&c, "dst", blocks, &m)?;
        dsts.push((c, m));
    }
    let (mut t1, mut t2) = (Vec::new(), Vec::new());
    let mut last_rails = Vec::new();
    for round in 0..a.rounds {
        for (i, peer) in ["one-rail", "two-rails"].into_iter().enumerate() {
            let (c, m) = &dsts[i];
            m.write(0, &vec![0u8; bytes as usize]).map_err(|e| e.to_string())?;
            let (secs, rails) = transfer(&src, c, peer, blocks, &format!("r{round}-{i}"))?;
            let mut got = vec![0u8; bytes as usize];
            m.read(0, &mut got).map_err(|e| e.to_string())?;
            if got != pattern {
                return Err(format!("{peer} round {round}: destination bytes differ"));
            }
            if i == 0 { &mut t1 } else { &mut t2 }.push(secs);
            if i == 1 {
                last_rails = rails;
            }
        }
    }
    let (m1, m2) = (median(t1), median(t2));
    let mb = bytes as f64 / 1e6;
    println!("link rate {} per rail (tc tbf at the sender); {} MiB per transfer, {} rounds, median of each", a.rate, a.mib, a.rounds);
    println!("one rail   {:8.1} MB/s  ({m1:.2} s)", mb / m1);
    println!("two rails  {:8.1} MB/s  ({m2:.2} s)", mb / m2);
    for r in &last_rails {
        println!("  {:6} {:>22}  {:6.1} MiB in {:3} slices{}", r.name, r.addr, r.bytes as f64 / 1048576.0, r.slices, r.failed.as_deref().map(|f| format!("  FAILED: {f}")).unwrap_or_default());
    }
    println!("ratio two/one: {:.2} (ideal 2.00)", m1 / m2);
    Ok(())
}

fn main() -> ExitCode {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if !netns::available() {
        eprintln!("kvwire-rails-bench needs root and iproute2 (network namespaces)");
        return ExitCode::from(3);
    }
    match run(&a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvwire-rails-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
