//! The proof, through real daemons: a prefill client's tinylm cache is moved
//! by two kvwired processes into another layout, and the decode logits match
//! a local computation bitwise; every identity mismatch and a corrupted byte
//! are refused before any flag.

use kvwire_core::protocol::{Header, Kind, HEADER_LEN};
use kvwire_e2e::scenario::{self, Scenario, ScenarioError};
use kvwire_testkit::{start_daemon, DaemonProc, TempDir};
use kvwire_e2e::tinylm;
use kvwire_client::client::{Client, Submitted};
use kvwire_client::control::FlagName;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const SECRET: &str = "e2e-shared-secret-0123456789";

struct Pair {
    _b: DaemonProc,
    _a: DaemonProc,
    ca: Client,
    cb: Client,
    /// The daemons' configs and sockets; last, so it goes after them.
    dir: TempDir,
}

fn pair(tag: &str, b_extra: &str) -> Pair {
    pair_with(tag, "", b_extra)
}

/// Both daemons serving device memory through the stand-in backend.
fn device_pair(tag: &str) -> Pair {
    let dev = "[device]\nbackend = \"host\"\n";
    pair_with(tag, dev, dev)
}

/// The decode daemon with `b_extra` in its config, the prefill daemon with `a_extra`.
fn pair_with(tag: &str, a_extra: &str, b_extra: &str) -> Pair {
    let d = TempDir::new(&format!("e2e-{tag}"));
    let b = start_daemon(d.path(), "decode-host", SECRET, &[], b_extra);
    let a = start_daemon(d.path(), "prefill-host", SECRET, &[("decode-host", &b.peer)], a_extra);
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    Pair { _b: b, _a: a, ca, cb, dir: d }
}

/// Bytes of hop `name` in a transfer's status, if it has the hop.
fn hop(st: &kvwire_client::control::TransferStatus, name: &str) -> Option<u64> {
    st.hops.iter().find(|h| h.hop == name).map(|h| h.bytes)
}

fn run(p: &Pair, sc: &Scenario) -> Result<scenario::Outcome, ScenarioError> {
    scenario::run(&p.ca, &p.cb, "decode-host", sc)
}

/// The measured end to end lies between the model's bounds, each with a
/// small slack. The lower one: the source's `wire` span ends when the last
/// ack reaches it, which can be after the destination already published —
/// the ack's trip back is in the span but not on the client's critical
/// path. The upper one: the client's clock also covers what no hop times —
/// its submit's trip to the daemon and the work before the slot is taken,
/// and the wake-up of its wait on the last flag.
fn between_bounds(t: &kvwire_core::timing::Prediction) -> Result<(), String> {
    let m = t.measured_ns.unwrap();
    // One rule for both sides: 2% of the bound, and at least 5 ms.
    let slack_of = |bound: u64| (bound / 50).max(5_000_000);
    let (slack, above) = (slack_of(t.lower_ns), slack_of(t.sequential_ns));
    match t.lower_ns <= m + slack && m <= t.sequential_ns + above {
        true => Ok(()),
        false => Err(format!("measured {m} outside [{} - {slack}, {} + {above}]: {t:?}", t.lower_ns, t.sequential_ns)),
    }
}

/// Runs a timed transfer (`attempt`, given its try's number) until one
/// lies between its model's bounds, at most three times. Wall time on 2
/// shared cores: a stall outside every hop (a preempted thread, a late
/// wake-up) can put one run past a bound by some ms, where a transfer that
/// runs hops one after another (nothing overlapped) sits at the upper one;
/// a model that missed a hop misses in every run.
fn between_bounds_in_one_of_three(mut attempt: impl FnMut(u32) -> kvwire_core::timing::Prediction) {
    let mut misses = Vec::new();
    for i in 0..3 {
        match between_bounds(&attempt(i)) {
            Ok(()) => return,
            Err(e) => misses.push(e),
        }
    }
    panic!("no run of three lay between the model's bounds:\n{}", misses.join("\n"));
}

fn assert_bitwise(o: &scenario::Outcome) {
    assert!(o.bitwise(), "logits differ from the local computation: max abs diff {}", o.max_abs_diff());
}

#[test]
fn lossless_remapped_transfers_decode_bitwise_identical() {
    let _shared = crate::shared();
    let p = pair("lossless", "");
    // TP4 NHD/16 -> TP2 HND/32, 100 tokens: a partial final block on both sides.
    let o = run(&p, &Scenario::new("tp4-tp2")).unwrap();
    assert_bitwise(&o);
    let per_token = 4 /*layers*/ * 4 /*kv heads*/ * 32 /*head_dim*/ * 2 /*K,V*/ * 4 /*fp32*/;
    assert_eq!(o.source.bytes, per_token * 100);
    assert_eq!(o.destination.bytes, per_token * 100);
    // TP2 -> TP8 over 4 KV heads: every head replicated twice at the destination.
    let mut sc = Scenario::new("tp2-tp8");
    sc.src_layout = "tp=2,block=16".into();
    sc.dst_layout = "tp=8,block=16,layout=hnd,table=shuffle:4".into();
    let o = run(&p, &sc).unwrap();
    assert_bitwise(&o);
    assert_eq!(o.source.bytes, 2 * per_token * 100);
    // An unequal PP split on the source side.
    let mut sc = Scenario::new("pp");
    sc.src_layout = "tp=2,pp=2,pp_layers=3,1,block=16".into();
    sc.dst_layout = "tp=1,block=32,table=shuffle:6".into();
    sc.tokens = 77;
    assert_bitwise(&run(&p, &sc).unwrap());
}

#[test]
fn a_prefill_streamed_layer_by_layer_decodes_bitwise_identical() {
    let _shared = crate::shared();
    let p = pair("stream", "");
    // Submitted before the prefill; each layer written and announced as
    // tinylm computes it, across a TP and layout remap with shuffled tables.
    let mut sc = Scenario::new("streamed");
    sc.stream = true;
    let o = run(&p, &sc).unwrap();
    assert_bitwise(&o);
    let names: Vec<&str> = o.source.marks.iter().map(|m| m.name.as_str()).collect();
    assert!((0..4).all(|l| names.contains(&format!("produced({l})").as_str())), "{names:?}");
    // The tail after the last layer is part of the end to end, never more.
    assert!(o.after_last_layer <= o.end_to_end);
    // A streamed engine-tensor source is refused before anything is registered.
    let mut sc = Scenario::new("streamed-engine");
    sc.stream = true;
    sc.src_layout = "tp=2,block=16,kv=vllm_nhd".into();
    match run(&p, &sc) {
        Err(ScenarioError::Setup(why)) => assert!(why.contains("not engine tensors"), "{why}"),
        other => panic!("expected a setup error, got {other:?}"),
    }
}

#[test]
fn a_device_resident_prefill_streamed_layer_by_layer_decodes_bitwise_identical() {
    let _shared = crate::shared();
    let p = device_pair("stream-device");
    // Both caches in the stand-in backend's device memory: the source stages
    // each layer device -> host as it is announced, the destination copies
    // each back before its layer_ready.
    let mut sc = Scenario::new("streamed-device");
    sc.stream = true;
    sc.memory = scenario::Memory::StandIn;
    let o = run(&p, &sc).unwrap();
    assert_bitwise(&o);
    let stage = o.source.hops.iter().find(|h| h.hop == "stage").expect("the source staged device memory");
    assert_eq!(stage.bytes, o.source.bytes, "every byte staged once, layer by layer");
    let names: Vec<&str> = o.destination.marks.iter().map(|m| m.name.as_str()).collect();
    assert!((0..4).all(|l| names.contains(&format!("device_complete({l})").as_str())), "{names:?}");
}

#[test]
fn engines_holding_their_own_per_layer_tensors_decode_bitwise_identical() {
    let _shared = crate::shared();
    let p = pair("engine", "");
    // The decode engine's cache is its own tensors, one memfd per layer
    // (per rank for the cross-layer one), registered as they are; it reads
    // them back by its own shape after the transfer.
    for (name, dst) in [
        ("engine-vllm-nhd", "tp=2,block=32,table=shuffle:2,kv=vllm_nhd"),
        ("engine-flashinfer", "tp=1,block=16,table=shuffle:3,kv=flashinfer"),
        ("engine-vllm-cpu", "tp=4,block=8,table=shuffle:5,kv=vllm_cpu"),
        ("engine-vllm-cross", "tp=2,block=16,kv=vllm_cross"),
        // Padded views: pages padded past their rows, K and V apart, heads of a wider row.
        ("engine-vllm-nhd-padded", "tp=2,block=32,table=shuffle:2,kv=vllm_nhd,pad=k40:b24:t64"),
        ("engine-vllm-cross-padded", "tp=2,block=16,kv=vllm_cross,pad=l8:h3"),
    ] {
        let mut sc = Scenario::new(name);
        sc.dst_layout = dst.into();
        let o = run(&p, &sc).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_bitwise(&o);
        assert_eq!(o.destination.bytes, 4 * 4 * 32 * 2 * 4 * 100, "{name}");
        assert_eq!(o.dst_stray_bytes, Some(0), "{name}: bytes outside the rows were written");
    }
    // Both sides engines: FlashInfer prefill TP4 -> vLLM NHD decode TP2, and
    // a vLLM cross-layer prefill TP2 -> vLLM CPU decode TP1.
    for (name, src, dst) in [
        ("engines-fi-nhd", "tp=4,block=16,table=shuffle:7,kv=flashinfer", "tp=2,block=32,table=shuffle:2,kv=vllm_nhd"),
        ("engines-cross-cpu", "tp=2,block=8,table=shuffle:1,kv=vllm_cross", "tp=1,block=16,table=shuffle:4,kv=vllm_cpu"),
        ("engines-padded", "tp=4,block=16,table=shuffle:7,kv=flashinfer,pad=b40:h4", "tp=2,block=32,table=shuffle:2,kv=vllm_hnd,pad=t3"),
    ] {
        let mut sc = Scenario::new(name);
        sc.src_layout = src.into();
        sc.dst_layout = dst.into();
        let o = run(&p, &sc).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_bitwise(&o);
        assert_eq!(o.dst_stray_bytes, Some(0), "{name}: bytes outside the rows were written");
    }
    // Negative control: the same bytes read as another layout decode to other logits.
    let mut sc = Scenario::new("engine-misread");
    sc.dst_layout = "tp=2,block=32,table=shuffle:2,kv=vllm_nhd".into();
    sc.dst_read_as = Some("vllm_hnd");
    let o = run(&p, &sc).unwrap();
    assert!(!o.bitwise(), "a cache read as the wrong layout still decoded bitwise");
}

#[test]
fn a_kept_peer_connection_the_destination_closed_is_replaced_by_a_new_one() {
    let _shared = crate::shared();
    // The destination closes a peer connection idle for its transfer
    // timeout (2 s here); the source keeps its connection after the first
    // transfer, finds it closed at the second, and connects anew.
    let p = pair("kept", "[limits]\ntransfer_timeout_secs = 2\npeer_timeout_secs = 1\n");
    assert_bitwise(&run(&p, &Scenario::new("kept-1")).unwrap());
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_bitwise(&run(&p, &Scenario::new("kept-2")).unwrap());
    // And straight after, on the connection the second transfer kept.
    assert_bitwise(&run(&p, &Scenario::new("kept-3")).unwrap());
}

#[test]
fn prefix_hit_moves_only_the_rest_and_decodes_bitwise() {
    let _shared = crate::shared();
    let p = pair("prefix", "");
    let mut sc = Scenario::new("prefix");
    sc.prefix = 40; // not block-aligned on either side
    let o = run(&p, &sc).unwrap();
    assert_bitwise(&o);
    let per_token = 4 * 4 * 32 * 2 * 4;
    assert_eq!(o.source.bytes, per_token * (100 - 40));
    assert_eq!(o.destination.reused_bytes, per_token * 40);
}

fn refused(p: &Pair, sc: &Scenario, needle: &str) {
    match run(p, sc) {
        Err(ScenarioError::Daemon { step: "submit", source }) => {
            assert!(source.to_string().contains(needle), "expected `{needle}` in: {source}");
        }
        Err(e) => panic!("expected a refused submit naming `{needle}`, got: {e}"),
        Ok(_) => panic!("transfer with `{needle}` was accepted"),
    }
}

#[test]
fn identity_mismatches_are_refused_before_any_flag() {
    let _shared = crate::shared();
    let p = pair("identity", "");
    let mut sc = Scenario::new("model");
    sc.src_identity = |i| i.model_digest = "0123456789abcdef".into();
    refused(&p, &sc, "model digest mismatch");
    let mut sc = Scenario::new("adapter");
    sc.src_identity = |i| i.adapter_digest = "another-adapter".into();
    refused(&p, &sc, "adapter digest mismatch");
    let mut sc = Scenario::new("shifted");
    sc.src_identity = |i| i.position_offset = 1;
    refused(&p, &sc, "position offset mismatch");
    let mut sc = Scenario::new("tenant");
    sc.prefix = 32;
    sc.dst_identity = |i| i.tenant = "other-tenant".into();
    refused(&p, &sc, "tenant mismatch");
}

#[test]
fn forcing_a_shifted_cache_would_change_the_logits() {
    let _shared = crate::shared();
    // What the position check prevents: a cache computed one position off,
    // decoded as if it were right.
    let cfg = scenario::config();
    let w = tinylm::Weights::seeded(&cfg, 7);
    let mut ws = w.clone();
    ws.cfg.rope_position_offset = 1;
    let tokens: Vec<u32> = (0..33).map(|i| (i * 37 % cfg.vocab) as u32).collect();
    let (good, _) = tinylm::prefill(&w, None, &tokens[..32]);
    let (bad, _) = tinylm::prefill(&ws, None, &tokens[..32]);
    let a = tinylm::decode_step(&w, None, &good, tokens[32], 32);
    let b = tinylm::decode_step(&w, None, &bad, tokens[32], 32);
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(diff > 1e-3, "a shifted cache changed nothing (max diff {diff})");
}

/// Forwards one TCP connection, flipping the first payload byte of the
/// third write frame from the source.
fn corrupting_proxy(listen: TcpListener, upstream: String) {
    std::thread::spawn(move || {
        for c in listen.incoming() {
            let Ok(mut down) = c else { return };
            let Ok(mut up) = TcpStream::connect(&upstream) else { return };
            let (mut up_r, mut down_w) = (up.try_clone().unwrap(), down.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut up_r, &mut down_w);
            });
            std::thread::spawn(move || {
                let mut writes = 0;
                loop {
                    let mut h = [0u8; HEADER_LEN];
                    if down.read_exact(&mut h).is_err() {
                        return;
                    }
                    let Ok(header) = Header::decode(&h, u64::MAX) else { return };
                    let mut payload = vec![0u8; header.len as usize];
                    if down.read_exact(&mut payload).is_err() {
                        return;
                    }
                    if header.kind == Kind::Write {
                        writes += 1;
                        if writes == 3 {
                            payload[0] ^= 0x40;
                        }
                    }
                    if up.write_all(&h).and_then(|()| up.write_all(&payload)).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

#[test]
fn a_corrupted_byte_in_transit_fails_the_checksum_and_publishes_nothing() {
    let _shared = crate::shared();
    corrupted_in_transit("corrupt", "");
}

#[test]
fn a_source_hashing_beside_the_wire_moves_bitwise_and_a_corrupted_byte_still_fails_its_layer() {
    let _shared = crate::shared();
    // Every transfer is packed and hashed beside the wire: the manifest
    // carries no checksums, each layer's follow, then its bytes, while the
    // layers before it move.
    let beside = "[transport]\nhash_beside_bytes = 0\n";
    let p = pair_with("beside", beside, "");
    for name in ["beside", "beside-remap"] {
        let mut sc = Scenario::new(name);
        if name == "beside-remap" {
            sc.src_layout = "tp=2,block=16,layout=nhd".into();
            sc.dst_layout = "tp=1,block=32,layout=hnd,table=shuffle:3".into();
        }
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        let verify = hop(&o.source, "verify");
        assert_eq!(verify, Some(o.source.bytes), "{name}: every byte hashed at the source: {:?}", o.source.hops);
    }
    corrupted_in_transit("corrupt-beside", "hash_beside_bytes = 0\n");
}

/// The decode daemon's data plane is reached through a proxy that flips
/// one byte; the prefill daemon's `[transport]` gets `a_transport` too.
fn corrupted_in_transit(tag: &str, a_transport: &str) {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_addr = proxy.local_addr().unwrap().to_string();
    let p = pair_with(
        tag,
        &format!("[transport]\n{a_transport}"),
        &format!("[transport]\ntcp_listen = \"127.0.0.1:{port}\"\ntcp_advertise = \"{proxy_addr}\"\n"),
    );
    corrupting_proxy(proxy, format!("127.0.0.1:{port}"));
    match run(&p, &Scenario::new(tag)) {
        Err(ScenarioError::Daemon { step, source }) => {
            assert!(step.starts_with("wait"), "{step}: {source}");
            let text = source.to_string();
            assert!(text.contains("failed"), "{text}");
        }
        Err(e) => panic!("unexpected: {e}"),
        Ok(o) => panic!("a corrupted transfer completed (logits bitwise: {})", o.bitwise()),
    }
    // The destination names the checksum and the place.
    let st = p.cb.status(0).or_else(|_| p.cb.status(1)).unwrap();
    let err = st.error.clone().unwrap_or_default();
    assert!(err.contains("checksum mismatch: dst rank"), "{err}");
    // Nothing from the corrupted layer on is published: not that layer's
    // flag, no later one, and not decoder_usable (layers verified before it
    // may have been, rightly).
    let bad: u16 = err.split("layer ").nth(1).and_then(|t| t.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no layer in {err}"));
    for l in bad..st.layers {
        assert!(!p.cb.ready(st.slot, FlagName::LayerReady(l)), "layer {l} published after layer {bad} failed its checksum");
    }
    assert!(!p.cb.ready(st.slot, FlagName::DecoderUsable));
    // One verdict: the source's transfer fails too, with the destination's reason.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let src = loop {
        let s = (0..8).filter_map(|i| p.ca.status(i).ok()).find(|s| s.role == "source");
        if let Some(s) = s.filter(|s| s.state != kvwire_client::control::TransferState::Running) {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "the source never heard the destination's verdict");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(src.state, kvwire_client::control::TransferState::Failed, "{src:?}");
    let why = src.error.unwrap_or_default();
    assert!(why.contains("the destination failed the transfer") && why.contains("checksum mismatch"), "{why}");
    assert!(!p.ca.ready(src.slot, FlagName::DecoderUsable), "the source published decoder_usable for a failed transfer");
}

/// Forwards every connection to `upstream` as it is, adding the bytes
/// that cross it both ways to `count`.
fn counting_proxy(listen: TcpListener, upstream: String, count: Arc<AtomicU64>) {
    std::thread::spawn(move || {
        for c in listen.incoming() {
            let Ok(down) = c else { return };
            let Ok(up) = TcpStream::connect(&upstream) else { return };
            let _ = (down.set_nodelay(true), up.set_nodelay(true));
            for (mut from, mut to) in [(down.try_clone().unwrap(), up.try_clone().unwrap()), (up, down)] {
                let count = count.clone();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 256 << 10];
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        count.fetch_add(n as u64, Ordering::SeqCst);
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
}

#[test]
fn a_transfers_wire_bytes_are_what_crossed_the_link() {
    let _shared = crate::shared();
    wire_bytes_by_hand("tcp");
}

#[test]
fn a_transfers_wire_bytes_over_shm_are_derived_by_hand() {
    let _shared = crate::shared();
    wire_bytes_by_hand("shm");
}

/// The peer control connection goes through a counting proxy, and over
/// tcp the data plane through one of its own: what each side reports as a
/// transfer's wire_bytes is what crossed, both ways. Over shm the data
/// plane has no socket to count, so its part is derived by hand only. The
/// first transfer opens (and authenticates) the connections the later ones
/// reuse, so those cross no handshake.
fn wire_bytes_by_hand(kind: &str) {
    let d = TempDir::new(&format!("e2e-wirebytes-{kind}"));
    let data_port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (data_proxy, peer_proxy) = (TcpListener::bind("127.0.0.1:0").unwrap(), TcpListener::bind("127.0.0.1:0").unwrap());
    let (data_addr, peer_addr) = (data_proxy.local_addr().unwrap().to_string(), peer_proxy.local_addr().unwrap().to_string());
    let (a_cfg, b_cfg) = match kind {
        "tcp" => (String::new(), format!("[transport]\ntcp_listen = \"127.0.0.1:{data_port}\"\ntcp_advertise = \"{data_addr}\"\n")),
        _ => (format!("[transport]\nkind = \"{kind}\"\n"), format!("[transport]\nkind = \"{kind}\"\n")),
    };
    let b = start_daemon(d.path(), "decode-host", SECRET, &[], &b_cfg);
    let a = start_daemon(d.path(), "prefill-host", SECRET, &[("decode-host", &peer_addr)], &a_cfg);
    let (data, control) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    if kind == "tcp" {
        counting_proxy(data_proxy, format!("127.0.0.1:{data_port}"), data.clone());
    }
    counting_proxy(peer_proxy, b.peer.clone(), control.clone());
    let p = Pair { ca: Client::connect(&a.socket, "prefill").unwrap(), cb: Client::connect(&b.socket, "decode").unwrap(), _b: b, _a: a, dir: d };
    let transfer = |name: &str, codec: Option<&str>| {
        // The proxies' threads may still be forwarding the last transfer's verdict.
        std::thread::sleep(std::time::Duration::from_millis(200));
        data.store(0, Ordering::SeqCst);
        control.store(0, Ordering::SeqCst);
        let mut sc = Scenario::new(name);
        sc.src_layout = "tp=1,block=16".into();
        sc.dst_layout = "tp=1,block=16".into();
        sc.codec = codec.map(str::to_string);
        let o = run(&p, &sc).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        (o, data.load(Ordering::SeqCst), control.load(Ordering::SeqCst))
    };
    assert_bitwise(&transfer(&format!("wirebytes-{kind}-1"), None).0);
    // Per write: tcp, a 40-byte header and a 40-byte answer; shm, a 40-byte
    // header and 64-byte trailer, and a 40-byte answer.
    let frame = match kind {
        "tcp" => 2 * HEADER_LEN as u64,
        _ => 2 * HEADER_LEN as u64 + kvwire_transport::shm::TRAILER_LEN,
    };
    // By hand: same layout and contiguous tables, so each layer's K and V
    // each go as one write of 100 tokens x 4 heads x 32 fp32: 8 writes.
    let (o, data_seen, control_seen) = transfer(&format!("wirebytes-{kind}-2"), None);
    assert_bitwise(&o);
    assert_eq!(o.source.bytes, 4 * 2 * 100 * 4 * 32 * 4);
    assert_eq!(o.source.compressed_bytes, o.source.bytes);
    let data_plane = o.source.bytes + 8 * frame;
    if kind == "tcp" {
        assert_eq!(data_seen, data_plane, "the data plane as the proxy saw it");
    }
    assert_eq!(o.source.wire_bytes, data_plane + control_seen, "the source's wire_bytes against the bytes that crossed");
    assert_eq!(o.destination.wire_bytes, data_plane + control_seen, "the destination's wire_bytes against the bytes that crossed");
    // Control is at least offer, accept, manifest, done and verdict, each
    // a 4-byte length, its JSON and a 32-byte seal.
    assert!((5 * 36..64 << 10).contains(&control_seen), "{control_seen} control bytes");
    // With the fp8 codec every row travels as 32 one-byte elements and an
    // f32 scale, staged: each layer's K and V lie back to back in staging
    // and go as one write.
    let (o, data_seen, control_seen) = transfer(&format!("wirebytes-{kind}-fp8"), Some("fp8_e4m3_row"));
    let rows = 4 * 2 * 100 * 4;
    assert_eq!(o.source.compressed_bytes, rows * (32 + 4), "fp8 payload");
    let data_plane = rows * (32 + 4) + 4 * frame;
    if kind == "tcp" {
        assert_eq!(data_seen, data_plane, "the data plane, fp8");
    }
    assert_eq!(o.source.wire_bytes, data_plane + control_seen, "the source's wire_bytes, fp8");
    assert_eq!(o.destination.wire_bytes, data_plane + control_seen, "the destination's wire_bytes, fp8");
}

#[test]
fn daemons_on_two_hosts_in_network_namespaces() {
    let _shared = crate::shared();
    use kvwire_testkit::netns;
    if !netns::available() {
        kvwire_testkit::skip("daemons_on_two_hosts_in_network_namespaces", kvwire_testkit::Need::Root, "needs root and iproute2");
        return;
    }
    let link = netns::Link::new("dmn").expect("namespaces");
    let d = TempDir::new("e2e-netns");
    let b = kvwire_testkit::start_daemon_in(Some(&link.a.name), &link.a.ip, d.path(), "decode-host", SECRET, &[], "");
    assert!(b.peer.starts_with(&link.a.ip), "{}", b.peer);
    let a = kvwire_testkit::start_daemon_in(Some(&link.b.name), &link.b.ip, d.path(), "prefill-host", SECRET, &[("decode-host", &b.peer)], "");
    let p = Pair { ca: Client::connect(&a.socket, "prefill").unwrap(), cb: Client::connect(&b.socket, "decode").unwrap(), _b: b, _a: a, dir: d };
    assert_bitwise(&run(&p, &Scenario::new("netns")).unwrap());
}

/// The CPUs this process may run on (`Cpus_allowed_list`), ascending.
fn allowed_cpus(pid: &str) -> Vec<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap();
    kvwire_transport::topology::parse_cpu_list(list).unwrap()
}

#[test]
fn daemons_on_cores_of_their_own_keep_to_them_poll_and_decode_bitwise() {
    let _shared = crate::shared();
    let cpus = allowed_cpus("self");
    // Each daemon on a CPU of its own where there are two.
    let (a_cpu, b_cpu) = (cpus[0], cpus[cpus.len() - 1]);
    for (tag, table) in [("tcp", ""), ("shm", "[transport]\nkind = \"shm\"\n")] {
        let p = pair_with(&format!("pinned-{tag}"), &format!("cpus = \"{a_cpu}\"\n{table}"), &format!("cpus = \"{b_cpu}\"\n{table}"));
        // Back to back, so the destination's threads poll between them.
        for i in 0..4 {
            let mut sc = Scenario::new(&format!("pinned-{tag}-{i}"));
            sc.tokens = 40 + 13 * i;
            assert_bitwise(&run(&p, &sc).unwrap());
        }
        // Every thread, those its transfers started too, keeps to its daemon's CPU.
        for (d, cpu) in [(&p._a, a_cpu), (&p._b, b_cpu)] {
            for task in std::fs::read_dir(format!("/proc/{}/task", d.pid())).unwrap() {
                let tid = task.unwrap().file_name().into_string().unwrap();
                assert_eq!(allowed_cpus(&format!("{}/task/{tid}", d.pid())), [cpu], "{tag}: thread {tid} of {} runs off its CPU", d.node);
            }
        }
    }
    // A list naming no CPU this process may use stops the daemon, named.
    let d = TempDir::new("e2e-pinned-nowhere");
    let secret = d.write_private("secret", SECRET);
    let cfg = d.path().join("nowhere.toml");
    std::fs::write(&cfg, format!("node = \"n\"\ncpus = \"1023\"\ncontrol_socket = {:?}\npeer_listen = \"127.0.0.1:0\"\nsecret_file = {:?}\n", d.path().join("n.sock").display().to_string(), secret.display().to_string())).unwrap();
    let o = std::process::Command::new(kvwire_testkit::kvwired_bin()).arg("--config").arg(&cfg).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("config key `cpus`") && err.contains("1023"), "kvwired on CPU 1023: {err}");
}

#[test]
fn concurrent_transfers_from_several_clients_are_all_exact() {
    let _shared = crate::shared();
    let d = TempDir::new("e2e-concurrent");
    let b = start_daemon(d.path(), "decode-host", SECRET, &[], "");
    let a = start_daemon(d.path(), "prefill-host", SECRET, &[("decode-host", &b.peer)], "");
    let outcomes: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|i| {
                let (a, b) = (&a, &b);
                s.spawn(move || {
                    let ca = Client::connect(&a.socket, "prefill").unwrap();
                    let cb = Client::connect(&b.socket, "decode").unwrap();
                    let mut sc = Scenario::new(&format!("c{i}"));
                    sc.tokens = 60 + 17 * i as u64;
                    scenario::run(&ca, &cb, "decode-host", &sc)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for o in outcomes {
        assert_bitwise(&o.unwrap());
    }
}

#[test]
fn a_client_dying_mid_transfer_releases_its_regions_and_nothing_else_is_affected() {
    let _shared = crate::shared();
    use kvwire_core::reuse::CacheIdentity;
    use kvwire_transport::HostMem;
    use kvwire_client::control::*;
    let d = TempDir::new("e2e-dying");
    let b = start_daemon(d.path(), "decode-host", SECRET, &[], "");
    let a = start_daemon(d.path(), "prefill-host", SECRET, &[("decode-host", &b.peer)], "");
    // A decode client registers, prepares, and dies before the bytes arrive.
    let spec = "name = \"big\"\ndtype = \"fp32\"\n[[layers]]\nrepeat = 8\nattention = \"dense\"\nkv_heads = 8\nhead_dim = 128\n";
    let id = CacheIdentity {
        model_digest: "big".into(),
        adapter_digest: String::new(),
        format: "fp32/v1".into(),
        tenant: "t".into(),
        rope: "theta=10000".into(),
        position_offset: 0,
    };
    let tokens = 4096u64;
    let reg = |c: &Client, group: &str, mem: &HostMem| {
        c.register(
            RegisterCache {
                group: group.into(),
                model: ModelSource::Toml(spec.into()),
                format: "fp32".into(),
                layout: "tp=1,block=16".into(),
                rank: 0,
                num_blocks: 256,
                identity: id.clone(),
            },
            mem,
        )
        .unwrap();
    };
    let bytes = 8 /*layers*/ * 2 * 256 /*blocks*/ * 16 * 8 * 128 * 4;
    let src_mem = HostMem::new("src", bytes).unwrap();
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    reg(&ca, "src", &src_mem);
    let dying = Client::connect(&b.socket, "dying").unwrap();
    let dst_mem = HostMem::new("dst", bytes).unwrap();
    reg(&dying, "dst", &dst_mem);
    let table: Vec<u32> = (0..256).collect();
    let slot = dying
        .prepare(PrepareReceive { group: "dst".into(), request: "r".into(), block_table: table.clone(), tokens, prefix_tokens: 0, source: None })
        .unwrap();
    drop(dying);
    // Its group is gone: the source is refused or fails cleanly, never "done".
    std::thread::sleep(std::time::Duration::from_millis(100));
    let submit = ca.submit(Submit {
        request: "p".into(),
        group: "src".into(),
        block_table: table.clone(),
        tokens,
        peer: "decode-host".into(),
        dst_group: "dst".into(),
        dst_request: "r".into(),
        codec: None,
        stream: false,
    });
    // Which one depends on whether the daemon has let the group go yet;
    // either way the outcome is named.
    match submit {
        Err(e) => {
            let text = e.to_string();
            assert!(text.contains("no group `dst`") || text.contains("is not prepared"), "refused for another reason: {text}");
        }
        Ok(Submitted { slot: s, .. }) => {
            // The source's verdict never comes as success.
            let verdict = ca.wait(s, FlagName::DecoderUsable, std::time::Duration::from_secs(20));
            assert!(verdict.is_err(), "a transfer into released regions completed");
            let st = ca.status(s).unwrap();
            assert_eq!(st.state, kvwire_client::control::TransferState::Failed, "{st:?}");
            assert!(st.error.as_deref().is_some_and(|e| !e.is_empty()), "failed without a reason: {st:?}");
        }
    }
    // The daemon keeps serving: the same group registers again, and a full scenario is exact.
    let cb = Client::connect(&b.socket, "decode").unwrap();
    reg(&cb, "dst", &dst_mem);
    let _ = slot;
    let p = Pair { ca, cb, _b: b, _a: a, dir: d };
    assert_bitwise(&run(&p, &Scenario::new("after")).unwrap());
}

#[test]
fn a_client_of_another_uid_is_refused() {
    let _shared = crate::shared();
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        kvwire_testkit::skip("a_client_of_another_uid_is_refused", kvwire_testkit::Need::Root, "needs root to run a client as another uid");
        return;
    }
    let d = TempDir::new("e2e-uid");
    let b = start_daemon(d.path(), "decode-host", SECRET, &[], "");
    // The socket is 0600: another uid cannot even connect. Open it up to
    // prove the daemon's own SO_PEERCRED check refuses it too.
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&b.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let sock = b.socket.clone();
    let pid = unsafe { nix::unistd::fork() }.unwrap();
    match pid {
        nix::unistd::ForkResult::Child => {
            let code = (|| {
                nix::unistd::setgid(nix::unistd::Gid::from_raw(65534)).ok()?;
                nix::unistd::setuid(nix::unistd::Uid::from_raw(65534)).ok()?;
                match Client::connect(&sock, "intruder") {
                    Err(e) if e.to_string().contains("400") && e.to_string().contains("uid 65534") => Some(0),
                    Err(e) => {
                        eprintln!("other uid got: {e}");
                        Some(1)
                    }
                    Ok(_) => Some(3),
                }
            })()
            .unwrap_or(2);
            std::process::exit(code);
        }
        nix::unistd::ForkResult::Parent { child } => {
            let status = nix::sys::wait::waitpid(child, None).unwrap();
            assert_eq!(status, nix::sys::wait::WaitStatus::Exited(child, 0), "the other uid was not refused by name");
        }
    }
    assert!(Client::connect(&b.socket, "owner").is_ok());
}

#[test]
fn packed_segments_travel_through_staging_and_decode_bitwise() {
    let _shared = crate::shared();
    let p = pair("packed", "");
    // TP4 NHD -> TP1 NHD: each source head's rows interleave at the
    // destination, so the plan packs them. A source rank holds its head's
    // rows back to back: with contiguous tables on both sides and 1100
    // tokens, each such segment is 137.5 KiB and goes from the cache into
    // the destination's staging as it is; only the destination scatters.
    // Split by a shuffled destination table into blocks of 2 KiB, they are
    // cheaper to gather than to send as writes of their own.
    // TP2 NHD -> TP1 NHD/32: a source row holds two heads, so each head's
    // runs are apart at the source too and are gathered there first (an HND
    // destination, its runs back to back, would take strided writes).
    for (name, tokens, src, dst, gathered) in [
        ("packed", 1100, "tp=4,block=16,layout=nhd", "tp=1,block=16,layout=nhd", false),
        ("packed-small", 100, "tp=4,block=16,layout=nhd", "tp=1,block=16,layout=nhd,table=shuffle:3", true),
        ("packed-gathered", 100, "tp=2,block=16,layout=nhd", "tp=1,block=32,layout=nhd,table=shuffle:3", true),
    ] {
        let mut sc = Scenario::new(name);
        sc.tokens = tokens;
        sc.src_layout = src.into();
        sc.dst_layout = dst.into();
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        assert_eq!((o.source.compressed_bytes, o.destination.compressed_bytes), (o.destination.bytes, o.destination.bytes), "{name}: packing moves the same bytes");
        assert!(o.source.segments < 4 * 2 * 4 * tokens, "{name}: rows were coalesced into strided segments");
        assert_eq!(hop(&o.destination, "unpack"), Some(o.destination.bytes), "{name}: every byte is scattered at the destination");
        match gathered {
            true => assert_eq!(hop(&o.source, "pack"), Some(o.source.bytes), "{name}: every byte is gathered at the source: {:?}", o.source.hops),
            false => assert_eq!(hop(&o.source, "pack"), None, "{name}: nothing is gathered at the source: {:?}", o.source.hops),
        }
    }
}

#[test]
fn a_remap_goes_as_strided_writes_over_tcp_and_shm_nothing_packed() {
    let _shared = crate::shared();
    // TP4 NHD/16 -> TP1 HND/32: a source rank's head is 32 rows x 128 B =
    // 4 KiB per destination block, back to back at the source and a block
    // apart at the destination. Both carry strided writes, so each segment
    // goes whole as one (tcp: frames of whole runs gathered from the cache
    // and scattered into place), nothing packed or unpacked.
    for kind in ["tcp", "shm"] {
        let cfg = format!("[transport]\nkind = \"{kind}\"\n");
        let p = pair_with(&format!("priced-{kind}"), &cfg, &cfg);
        let mut sc = Scenario::new(&format!("priced-{kind}"));
        sc.tokens = 1100;
        sc.src_layout = "tp=4,block=16,layout=nhd".into();
        sc.dst_layout = "tp=1,block=32,layout=hnd".into();
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        let (unpacked, packed) = (hop(&o.destination, "unpack"), hop(&o.source, "pack"));
        // The same segments both ways; only how each goes differs.
        assert_eq!(o.source.segments, 4 * 2 * 4 * 2, "{kind}");
        // Per (layer, K/V, head): a segment of the 34 whole destination
        // blocks, and the last block's 12 rows (1100 = 34 x 32 + 12), one
        // run, which goes as a write of its own either way.
        assert_eq!(unpacked, None, "{kind}: {:?}", o.destination.hops);
        assert_eq!(o.destination.staging_bytes, 0, "{kind}");
        assert_eq!(packed, None, "{kind}: {:?}", o.source.hops);
    }
}

#[test]
fn a_gathered_segment_whose_destination_runs_are_back_to_back_lands_in_place() {
    let _shared = crate::shared();
    // TP2 NHD/64 -> TP1 HND/64 over tcp: a source rank's rows of a head lie
    // a head apart (gathered), a destination block's rows of a head back to
    // back. A whole block is 64 rows x 128 B = 8 KiB: written straight into
    // place, never unpacked. The last block (300 = 4 x 64 + 44) is 44 rows,
    // 5.5 KiB, below a write of its own: staged and unpacked. The same
    // into stand-in device memory, its host mirror copied to the device.
    for (name, p, memory) in [("placed", pair("placed", ""), scenario::Memory::Host), ("placed-device", device_pair("placed-device"), scenario::Memory::StandIn)] {
        let mut sc = Scenario::new(name);
        sc.memory = memory;
        sc.tokens = 300;
        sc.src_layout = "tp=2,block=64,layout=nhd,table=shuffle:1".into();
        sc.dst_layout = "tp=1,block=64,layout=hnd,table=shuffle:2".into();
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        // Layers x K/V x heads x the last block's rows x row bytes.
        let partial = 4 * 2 * 4 * 44 * 128;
        assert_eq!(hop(&o.destination, "unpack"), Some(partial), "{name}: {:?}", o.destination.hops);
        assert_eq!(hop(&o.source, "pack"), Some(o.source.bytes), "{name}: {:?}", o.source.hops);
    }
}

#[test]
fn a_layer_larger_than_a_checksum_chunk_is_hashed_in_parts_at_both_ends_and_decodes_bitwise() {
    let _shared = crate::shared();
    // 2100 tokens: each layer is 2100 x 4 heads x 128 B x (K, V) = 2.05 MiB
    // at the destination, so from 2 cores on it lands in two parts; each
    // region's stream is two checksum chunks (1 MiB, then the rest), and a
    // part may hold one chunk of a region and the next part the other. Into
    // HND (K and V regions) and into FlashInfer's one tensor per layer
    // (one region); the source packs and hashes whole (below
    // hash_beside_bytes), layer by layer in parts (above it), or, from
    // stand-in device memory, each layer in its ring slot in parts.
    let fi = "tp=1,block=32,kv=flashinfer,table=shuffle:3";
    let dev = "[device]\nbackend = \"host\"\n";
    for (name, a, b, dst, memory) in [
        ("chunks-hnd", "", "", "tp=1,block=32,layout=hnd,table=shuffle:3", scenario::Memory::Host),
        ("chunks-fi", "", "", fi, scenario::Memory::Host),
        ("chunks-fi-beside", "[transport]\nhash_beside_bytes = 0\n", "", fi, scenario::Memory::Host),
        ("chunks-fi-device", dev, dev, fi, scenario::Memory::StandIn),
    ] {
        let p = pair_with(name, a, b);
        let mut sc = Scenario::new(name);
        sc.memory = memory;
        sc.tokens = 2100;
        sc.src_layout = "tp=2,block=16,layout=nhd".into();
        sc.dst_layout = dst.into();
        let o = run(&p, &sc).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_bitwise(&o);
        assert_eq!(hop(&o.source, "verify"), Some(o.source.bytes), "{name}: {:?}", o.source.hops);
        assert_eq!(hop(&o.destination, "verify"), Some(o.source.bytes), "{name}: {:?}", o.destination.hops);
    }
}

/// Top-1 agreement and max abs logit error of `codec` over `prompts` prompts.
fn codec_quality(prompts: u64) -> (f64, f32) {
    use kvwire_core::codec::{decode_rows, encode_rows};
    let cfg = scenario::config();
    let w = tinylm::Weights::seeded(&cfg, 7);
    let (mut agree, mut worst) = (0u64, 0f32);
    for i in 0..prompts {
        let toks = scenario::prompt(65, cfg.vocab, 1000 + i);
        let (cache, _) = tinylm::prefill(&w, None, &toks[..64]);
        let mut lossy = cache.clone();
        for layer in lossy.k.iter_mut().chain(lossy.v.iter_mut()) {
            let bytes: Vec<u8> = layer.iter().flat_map(|v| v.to_le_bytes()).collect();
            let back = decode_rows(&encode_rows(&bytes, 4, cfg.head_dim), 4, cfg.head_dim);
            *layer = back.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        }
        let a = tinylm::decode_step(&w, None, &cache, toks[64], 64);
        let b = tinylm::decode_step(&w, None, &lossy, toks[64], 64);
        let argmax = |v: &[f32]| v.iter().enumerate().fold(0, |m, (j, x)| if *x > v[m] { j } else { m });
        agree += u64::from(argmax(&a) == argmax(&b));
        worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(worst, f32::max);
    }
    (agree as f64 / prompts as f64, worst)
}

/// Stated tolerance of the fp8 codec on tinylm: at least 95% top-1
/// agreement over 64 prompts, and no logit off by more than 0.25.
const FP8_TOP1: f64 = 0.95;
const FP8_MAX_ABS: f32 = 0.25;

#[test]
fn fp8_codec_quality_over_many_prompts_is_within_the_stated_tolerance() {
    let _shared = crate::shared();
    let (top1, worst) = codec_quality(64);
    eprintln!("fp8_e4m3_row codec over 64 prompts: top-1 agreement {:.1}%, max abs logit error {worst:.4}", top1 * 100.0);
    assert!(top1 >= FP8_TOP1, "top-1 agreement {top1}");
    assert!(worst <= FP8_MAX_ABS, "max abs logit error {worst}");
}

#[test]
fn fp8_codec_through_daemons_reports_compressed_bytes_and_stays_in_tolerance() {
    let _shared = crate::shared();
    let p = pair("codec", "");
    let mut sc = Scenario::new("fp8");
    sc.codec = Some("fp8_e4m3_row".into());
    let o = run(&p, &sc).unwrap();
    // Lossy: judged by the logits, not the bytes.
    assert!(o.max_abs_diff() <= FP8_MAX_ABS, "max abs diff {}", o.max_abs_diff());
    let rows = 4 /*layers*/ * 2 /*K,V*/ * 4 /*heads*/ * 100 /*tokens*/;
    assert_eq!(o.destination.bytes, rows * 32 * 4, "payload: fp32 rows");
    assert_eq!(o.destination.compressed_bytes, rows * (32 + 4), "wire: one fp8 byte per element + an f32 scale per row");
    assert_eq!(o.source.compressed_bytes, o.destination.compressed_bytes);
    let stats = p.ca.stats().unwrap();
    assert!(stats.contains(&format!("kvwire_compressed_bytes_total{{node=\"prefill-host\"}} {}", rows * 36)), "{stats}");
    // A codec the destination's format cannot take is refused by name.
    let mut sc = Scenario::new("badcodec");
    sc.codec = Some("zstd".into());
    match run(&p, &sc) {
        Err(ScenarioError::Daemon { source, .. }) => assert!(source.to_string().contains("unknown codec"), "{source}"),
        other => panic!("unexpected: {other:?}"),
    }
}

/// Daemons on two namespace hosts; `shape` limits the source host's egress.
fn netns_pair(tag: &str, shape: Option<&str>, extra: &str) -> Option<(kvwire_testkit::netns::Link, Pair)> {
    use kvwire_testkit::netns;
    if !netns::available() {
        kvwire_testkit::skip(tag, kvwire_testkit::Need::Root, "needs root and iproute2");
        return None;
    }
    let link = netns::Link::new(tag).expect("namespaces");
    if let Some(rate) = shape {
        link.b.shape(rate).expect("tc shaping");
    }
    let d = TempDir::new(&format!("e2e-{tag}"));
    let b = kvwire_testkit::start_daemon_in(Some(&link.a.name), &link.a.ip, d.path(), "decode-host", SECRET, &[], extra);
    let a = kvwire_testkit::start_daemon_in(Some(&link.b.name), &link.b.ip, d.path(), "prefill-host", SECRET, &[("decode-host", &b.peer)], extra);
    let p = Pair { ca: Client::connect(&a.socket, "prefill").unwrap(), cb: Client::connect(&b.socket, "decode").unwrap(), _b: b, _a: a, dir: d };
    Some((link, p))
}

#[test]
fn a_shaped_link_is_named_the_bottleneck() {
    let _alone = crate::alone();
    // 8 MB through 200 Mbit/s: the wire takes ~0.35 s, verification several
    // ms per side — room between the two bounds for the measurement.
    let Some((_link, p)) = netns_pair("shaped", Some("200mbit"), "") else { return };
    between_bounds_in_one_of_three(|i| {
        let mut sc = Scenario::new(&format!("shaped-{i}"));
        sc.tokens = 2000;
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        let (_, t) = scenario::timing(&o, 4);
        eprintln!("shaped link: {t:?}");
        assert_eq!(t.bounding.as_deref(), Some("wire (source)"), "{t:?}");
        t
    });
}

#[test]
fn a_converting_codec_over_a_fast_link_is_named_the_bottleneck() {
    let _alone = crate::alone();
    // Unshaped link, fp8 codec: the wire carries 36 of every 128 bytes while
    // every element is converted at both ends — the conversion hops (pack
    // at the source, unpack at the destination) are now the slow ones.
    // Checksums are off on both daemons so that only the codec does per-element work.
    // Below hash_beside_bytes the source converts the whole transfer
    // before its first write, on both cores (faster here than one core
    // converting layer by layer beside the wire): hardly any overlap, so
    // the measurement sits at the upper bound.
    let Some((_link, p)) = netns_pair("codec", None, "verify_checksums = false\n") else { return };
    between_bounds_in_one_of_three(|i| {
        let mut sc = Scenario::new(&format!("bigcodec-{i}"));
        sc.tokens = 1000;
        sc.codec = Some("fp8_e4m3_row".into());
        let o = run(&p, &sc).unwrap();
        let (stages, t) = scenario::timing(&o, 4);
        eprintln!("unshaped link, fp8 codec: {stages:?}\n{t:?}");
        let b = t.bounding.clone().unwrap_or_default();
        assert!(b.starts_with("pack") || b.starts_with("unpack"), "{t:?}");
        t
    });
}

#[test]
fn device_resident_caches_stage_through_host_mirrors_and_decode_bitwise() {
    let _shared = crate::shared();
    // Both daemons serve device memory through the stand-in backend: the
    // caches are registered as device allocations, copied device → host at
    // the source and host → device at the destination, where each layer is
    // published only after its copies' event completed.
    let p = device_pair("device");
    for (name, prefix) in [("device", 0), ("device-prefix", 40)] {
        let mut sc = Scenario::new(name);
        sc.memory = scenario::Memory::StandIn;
        sc.prefix = prefix;
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        let hop = |st: &kvwire_client::control::TransferStatus, name: &str| {
            st.hops.iter().find(|h| h.hop == name).map(|h| h.bytes).unwrap_or_else(|| panic!("no `{name}` hop in {:?}", st.hops))
        };
        // Every byte the plan reads was staged to the host, every byte it
        // writes went back to the device.
        assert_eq!(hop(&o.source, "stage"), o.source.bytes, "{name}: {:?}", o.source.hops);
        assert_eq!(hop(&o.destination, "device_complete"), o.destination.bytes, "{name}: {:?}", o.destination.hops);
        // The ranks copied side by side: the hop's time is the union of
        // their intervals, at least the busiest rank's and at most their
        // sum, and each rank's own figure sits beside it.
        for (st, name, ranks) in [(&o.source, "stage", 4), (&o.destination, "device_complete", 2)] {
            let h = st.hops.iter().find(|h| h.hop == name).unwrap();
            assert_eq!(h.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), (0..ranks).collect::<Vec<u32>>(), "{h:?}");
            assert_eq!(h.ranks.iter().map(|r| r.bytes).sum::<u64>(), h.bytes, "{h:?}");
            let (busiest, sum) = (h.ranks.iter().map(|r| r.ns).max().unwrap(), h.ranks.iter().map(|r| r.ns).sum::<u64>());
            assert!(busiest <= h.ns && h.ns <= sum, "union {} outside [{busiest}, {sum}]: {h:?}", h.ns);
        }
        // device_complete(L) precedes layer_ready(L) on the destination's
        // clock, and the layers are published in order (the next one lands
        // while a layer's copies run, but is not published before it).
        let at = |m: &str| mark_at(name, &o.destination, m);
        for l in 0..4 {
            assert!(at(&format!("device_complete({l})")) <= at(&format!("layer_ready({l})")), "{name}: layer {l}: {:?}", o.destination.marks);
        }
        for l in 1..4 {
            assert!(at(&format!("layer_ready({})", l - 1)) <= at(&format!("layer_ready({l})")), "{name}: layer {l}: {:?}", o.destination.marks);
        }
        // The source stages layer by layer, the next layer's copies beside
        // this layer's writes: its first write goes out before the last
        // layer's device → host copies complete (they are only started
        // once layer 1 was moved), and every copy ends before the release.
        let src = |m: &str| mark_at(name, &o.source, m);
        for l in 1..4 {
            assert!(src(&format!("host_staged({})", l - 1)) <= src(&format!("host_staged({l})")), "{name}: {:?}", o.source.marks);
        }
        assert!(src("posting") < src("host_staged(3)"), "{name}: the first write waited for every layer's copies: {:?}", o.source.marks);
        assert!(src("host_staged(3)") <= src("source_released"), "{name}: {:?}", o.source.marks);
        assert_ring(name, &o.source, 2, 4);
    }
    // The destination already holds every position: nothing moves, and the
    // source's ring has no bytes to hold.
    let mut sc = Scenario::new("device-prefix-all");
    sc.memory = scenario::Memory::StandIn;
    sc.prefix = sc.tokens;
    let o = run(&p, &sc).unwrap();
    assert_bitwise(&o);
    assert_eq!((o.source.bytes, o.source.staging_bytes), (0, 0), "{:?}", o.source);
    // With a codec the source converts rows from its ring's footprint into
    // the slot's end: it decodes to what the same transfer from host
    // memory decodes to, bit for bit.
    let coded = |memory| {
        let mut sc = Scenario::new(&format!("device-fp8-{}", matches!(memory, scenario::Memory::StandIn)));
        sc.memory = memory;
        sc.codec = Some("fp8_e4m3_row".into());
        run(&p, &sc).unwrap()
    };
    let (dev, host) = (coded(scenario::Memory::StandIn), coded(scenario::Memory::Host));
    assert_eq!(dev.remote, host.remote, "device-resident fp8 against host fp8");
    assert_eq!(hop(&dev.source, "stage"), Some(dev.source.bytes), "{:?}", dev.source.hops);
    assert!(dev.source.compressed_bytes < dev.source.bytes, "{:?}", dev.source);
    assert_ring("device-fp8", &dev.source, 2, 4);
    // Pinned host memory, from each daemon's gauge: the prefill daemon
    // holds only a ring, kept for its next transfer (a whole MiB: rings
    // here are about 100 KiB, and each transfer took the kept one), and
    // never pinned its ranks' mirrors, as it only sent; the decode daemon
    // pinned its mirrors at its first prepare, and holds no ring.
    let pinned = |c: &Client, what: &str| -> u64 {
        let text = c.stats().unwrap();
        let line = text.lines().find(|l| l.starts_with("kvwire_pinned_host_bytes{") && l.contains(&format!("for=\"{what}\""))).unwrap_or_else(|| panic!("no pinned {what} gauge"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!((pinned(&p.ca, "ring"), pinned(&p.ca, "mirror")), (1 << 20, 0), "the prefill daemon's pinned ring and mirror bytes");
    assert_eq!(pinned(&p.cb, "ring"), 0, "the decode daemon's pinned ring bytes");
    assert!(pinned(&p.cb, "mirror") >= dev.destination.bytes, "the decode daemon's mirrors hold its ranks");
}

#[test]
fn groups_of_device_and_host_ranks_stage_only_their_device_ranks_and_decode_bitwise() {
    let _shared = crate::shared();
    // Both groups mix memories: even ranks in (stand-in) device memory,
    // odd ranks in host memfds. The source's ring takes device ranks'
    // bytes by device → host copies and host ranks' by plain copies; the
    // destination copies host → device only into its device rank.
    let p = device_pair("mixed");
    for (name, prefix) in [("mixed", 0), ("mixed-prefix", 40)] {
        let mut sc = Scenario::new(name);
        sc.memory = scenario::Memory::Mixed;
        sc.prefix = prefix;
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        let ranks = |st: &kvwire_client::control::TransferStatus, hop: &str| -> Vec<(u32, u64)> {
            let h = st.hops.iter().find(|h| h.hop == hop).unwrap_or_else(|| panic!("{name}: no `{hop}` hop in {:?}", st.hops));
            h.ranks.iter().map(|r| (r.rank, r.bytes)).collect()
        };
        // Only device ranks were copied from the device, and only the
        // device rank was copied to it; every rank moved bytes.
        let staged = ranks(&o.source, "stage");
        assert_eq!(staged.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0, 2], "{name}: {staged:?}");
        assert!(staged.iter().all(|r| r.1 > 0) && staged.iter().map(|r| r.1).sum::<u64>() < o.source.bytes, "{name}: {staged:?} of {}", o.source.bytes);
        let landed = ranks(&o.destination, "device_complete");
        assert_eq!(landed.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0], "{name}: {landed:?}");
        assert!(landed[0].1 > 0 && landed[0].1 < o.destination.bytes, "{name}: {landed:?} of {}", o.destination.bytes);
        // The ring's rules hold with host ranks in it: a slot is reused
        // only after its writes, and the source is released at the last
        // layer's copies.
        let src = |m: &str| mark_at(name, &o.source, m);
        for l in 0..4usize {
            assert!(src(&format!("host_staged({l})")) <= src(&format!("sent({l})")), "{name}: {:?}", o.source.marks);
            if l + 2 < 4 {
                assert!(src(&format!("sent({l})")) <= src(&format!("staging({})", l + 2)), "{name}: slot of layer {l} reused early: {:?}", o.source.marks);
            }
        }
        assert!(src("host_staged(3)") <= src("source_released"), "{name}: {:?}", o.source.marks);
        assert!(o.source.staging_bytes > 0 && o.source.staging_bytes < o.source.bytes, "{name}: {:?}", o.source);
    }
}

#[test]
fn a_device_source_read_in_place_by_the_nic_writes_before_its_copies_and_is_released_after_its_writes() {
    let _shared = crate::shared();
    // The prefill daemon reads its stand-in device memory in place
    // (`gpudirect = "on"`: over tcp only the stand-in's host memory can
    // be, which is what this tests: the daemon's side of the path). Its
    // copies sleep first, so a write that waited for them would show.
    let dev = "[device]\nbackend = \"host\"\n";
    let p = pair_with("in-place", &format!("{dev}gpudirect = \"on\"\nstandin_delay_ms = 3\n"), dev);
    for (name, memory, prefix) in [("in-place", scenario::Memory::StandIn, 0), ("in-place-prefix", scenario::Memory::StandIn, 40), ("in-place-mixed", scenario::Memory::Mixed, 0)] {
        let mut sc = Scenario::new(name);
        sc.memory = memory;
        sc.prefix = prefix;
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        let src = |m: &str| mark_at(name, &o.source, m);
        // Each layer's in-place writes went out before its copies (for
        // its checksums and what is gathered) completed, and the slot
        // rule of the ring still holds for those copies.
        for l in 0..4 {
            assert!(src(&format!("staging({l})")) <= src(&format!("host_staged({l})")) && src(&format!("host_staged({l})")) <= src(&format!("sent({l})")), "{name}: {:?}", o.source.marks);
            if l + 2 < 4 {
                assert!(src(&format!("sent({l})")) <= src(&format!("staging({})", l + 2)), "{name}: slot of layer {l} reused early: {:?}", o.source.marks);
            }
        }
        assert!(src("posting") < src("host_staged(0)"), "{name}: the first write waited for the first copies: {:?}", o.source.marks);
        // What was not gathered went from device memory.
        assert!(o.source.in_place_bytes > 0 && o.source.in_place_bytes <= o.source.bytes, "{name}: {:?}", o.source);
        // The NIC reads the engine's memory until the last writes
        // complete: the source is released only then, not at its copies.
        assert!(src("sent(3)") <= src("source_released"), "{name}: released while its writes still read device memory: {:?}", o.source.marks);
        // Every byte the plan reads from device memory was still copied
        // to the host, for its checksums (mixed: the host ranks' are not).
        let staged = hop(&o.source, "stage").unwrap_or(0);
        match memory {
            scenario::Memory::Mixed => assert!(staged > 0 && staged < o.source.bytes, "{name}: {:?}", o.source.hops),
            _ => assert_eq!(staged, o.source.bytes, "{name}: {:?}", o.source.hops),
        }
    }
    // With a codec, every segment's rows are converted in the ring: none
    // is read in place, and it decodes as the same transfer from host memory.
    let coded = |memory| {
        let mut sc = Scenario::new(&format!("in-place-fp8-{}", matches!(memory, scenario::Memory::StandIn)));
        sc.memory = memory;
        sc.codec = Some("fp8_e4m3_row".into());
        run(&p, &sc).unwrap()
    };
    assert_eq!(coded(scenario::Memory::StandIn).remote, coded(scenario::Memory::Host).remote, "in place fp8 against host fp8");
    // Each daemon reports every device allocation's path: the prefill
    // daemon's are read in place; the decode daemon (`auto`, over tcp)
    // stages, and says why.
    let paths = |c: &Client| -> Vec<String> { c.stats().unwrap().lines().filter(|l| l.starts_with("kvwire_device_memory{")).map(str::to_owned).collect() };
    let a = paths(&p.ca);
    assert!(!a.is_empty() && a.iter().all(|l| l.contains("path=\"direct\"") && l.contains("how=\"the stand-in's host memory")), "{a:?}");
    let b = paths(&p.cb);
    assert!(!b.is_empty() && b.iter().all(|l| l.contains("path=\"staged\"") && l.contains("why=\"the tcp transport reads memory through a host mapping")), "{b:?}");
    drop(p);
    // With checksums off nothing needs the bytes on the host: read in
    // place, the source copies nothing and holds no ring; gathered
    // segments (a codec gathers all) still go through it.
    let p = pair_with("in-place-unverified", &format!("verify_checksums = false\n{dev}gpudirect = \"on\"\n"), &format!("verify_checksums = false\n{dev}"));
    let mut sc = Scenario::new("in-place-unverified");
    sc.memory = scenario::Memory::StandIn;
    let o = run(&p, &sc).unwrap();
    assert_bitwise(&o);
    assert_eq!((hop(&o.source, "stage"), o.source.staging_bytes), (None, 0), "{:?} {:?}", o.source.hops, o.source);
    assert_eq!(o.source.in_place_bytes, o.source.bytes, "every byte from device memory: {:?}", o.source);
    assert!(mark_at("in-place-unverified", &o.source, "sent(3)") <= mark_at("in-place-unverified", &o.source, "source_released"), "{:?}", o.source.marks);
    sc.codec = Some("fp8_e4m3_row".into());
    sc.name = "in-place-unverified-fp8".into();
    let o = run(&p, &sc).unwrap();
    assert!(hop(&o.source, "stage").is_some_and(|b| b > 0) && o.source.staging_bytes > 0, "{:?} {:?}", o.source.hops, o.source);
}

#[test]
fn a_device_source_ring_of_any_depth_reuses_a_slot_only_after_its_writes_with_slow_copies() {
    let _shared = crate::shared();
    let dev = "[device]\nbackend = \"host\"\n";
    for depth in [1, 3] {
        // Every copy of the source's stand-in device sleeps first: the
        // copies, not the wire, bound the transfer.
        let p = pair_with(&format!("ring-{depth}"), &format!("{dev}ring_depth = {depth}\nstandin_delay_ms = 3\n"), dev);
        let mut sc = Scenario::new(&format!("ring-{depth}"));
        sc.memory = scenario::Memory::StandIn;
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        assert_ring(&sc.name, &o.source, depth, 4);
        // Streamed: a layer's copies start only once it is written, and
        // the slot rule holds all the same.
        let mut sc = Scenario::new(&format!("ring-{depth}-streamed"));
        sc.memory = scenario::Memory::StandIn;
        sc.stream = true;
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        let at = |m: &str| mark_at("", &o.source, m);
        for l in 0..4 {
            assert!(at(&format!("produced({l})")) <= at(&format!("staging({l})")), "{:?}", o.source.marks);
            if l + depth < 4 {
                assert!(at(&format!("sent({l})")) <= at(&format!("staging({})", l + depth)), "{:?}", o.source.marks);
            }
        }
        assert!(at("host_staged(3)") <= at("source_released"), "{:?}", o.source.marks);
        // Layers of 300 KiB: each goes on the wire from a thread of its
        // own while the next is packed and hashed; the slot rule holds, and
        // with one slot the next layer waits for this one's writes.
        let mut sc = Scenario::new(&format!("ring-{depth}-large"));
        sc.memory = scenario::Memory::StandIn;
        sc.tokens = 300;
        let o = run(&p, &sc).unwrap();
        assert_bitwise(&o);
        assert_ring(&sc.name, &o.source, depth, 4);
    }
}

/// A device-resident source's staging ring of `depth` slots, from its own
/// marks: layer L's copies start only once layer L - depth's writes
/// completed (the slot it reuses is free), and with two slots or more the
/// next layer's copies start before this one's writes end. The source is
/// released at its last copies, before its last writes complete. It holds
/// `depth` layers' bytes (their footprint and what it packs; the layers
/// here are alike), not the transfer's.
/// When mark `m` was reached in `st`, for scenario `name`; a missing mark fails the test.
pub(crate) fn mark_at(name: &str, st: &kvwire_client::control::TransferStatus, m: &str) -> u64 {
    st.marks.iter().find(|k| k.name == m).map(|k| k.at_ns).unwrap_or_else(|| panic!("{name}: no mark {m}: {:?}", st.marks))
}

pub(crate) fn assert_ring(name: &str, st: &kvwire_client::control::TransferStatus, depth: usize, layers: usize) {
    let at = |m: &str| mark_at(name, st, m);
    for l in 0..layers {
        assert!(at(&format!("staging({l})")) <= at(&format!("host_staged({l})")), "{name}: {:?}", st.marks);
        assert!(at(&format!("host_staged({l})")) <= at(&format!("sent({l})")), "{name}: {:?}", st.marks);
        if l + depth < layers {
            assert!(at(&format!("sent({l})")) <= at(&format!("staging({})", l + depth)), "{name}: slot of layer {l} reused before its writes completed: {:?}", st.marks);
        }
        if depth > 1 && l + 1 < layers {
            assert!(at(&format!("staging({})", l + 1)) < at(&format!("sent({l})")), "{name}: layer {} was not copied beside layer {l}'s writes: {:?}", l + 1, st.marks);
        }
    }
    let last = layers - 1;
    assert!(at(&format!("host_staged({last})")) <= at("source_released") && at("source_released") <= at(&format!("sent({last})")), "{name}: {:?}", st.marks);
    let bytes = |h: &str| st.hops.iter().find(|x| x.hop == h).map_or(0, |x| x.bytes);
    let per_layer = (bytes("stage") + bytes("pack")) / layers as u64;
    // With a codec the packed rows take their converted size, less than the pack hop's.
    match st.compressed_bytes == st.bytes {
        true => assert_eq!(st.staging_bytes, depth as u64 * per_layer, "{name}: {:?}", st.hops),
        false => assert!(st.staging_bytes < depth as u64 * per_layer, "{name}: {} staging bytes: {:?}", st.staging_bytes, st.hops),
    }
    if depth < layers {
        assert!(st.staging_bytes < st.bytes, "{name}: the ring held {} bytes for a {}-byte transfer", st.staging_bytes, st.bytes);
    }
}

#[test]
fn engine_tensors_each_in_its_own_device_allocation_decode_bitwise() {
    let _shared = crate::shared();
    // vLLM's GPU cache: one tensor per layer, each its own device
    // allocation (here the stand-in backend's), registered as they are.
    // Each allocation is staged through a host mirror of its own.
    let p = device_pair("device-engine");
    for (name, src, dst) in [
        ("dev-engine-nhd", "tp=4,block=16,table=shuffle:3", "tp=2,block=32,table=shuffle:2,kv=vllm_nhd"),
        ("dev-engines-fi-hnd", "tp=4,block=16,table=shuffle:7,kv=flashinfer", "tp=1,block=16,table=shuffle:5,kv=vllm_hnd"),
        ("dev-engine-cross", "tp=2,block=8,table=shuffle:1,kv=vllm_cross", "tp=2,block=16,table=shuffle:4,kv=vllm_nhd"),
        ("dev-engines-padded", "tp=4,block=16,table=shuffle:7,kv=flashinfer,pad=b40", "tp=2,block=16,table=shuffle:5,kv=vllm_nhd,pad=t16:k8"),
    ] {
        let mut sc = Scenario::new(name);
        sc.memory = scenario::Memory::StandIn;
        sc.src_layout = src.into();
        sc.dst_layout = dst.into();
        let o = run(&p, &sc).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_bitwise(&o);
        assert_eq!(o.dst_stray_bytes, Some(0), "{name}: bytes outside the rows were written");
        assert_eq!(hop(&o.source, "stage"), Some(o.source.bytes), "{name}: every byte read was staged from the device: {:?}", o.source.hops);
        assert_eq!(hop(&o.destination, "device_complete"), Some(o.destination.bytes), "{name}: every byte written went to the device: {:?}", o.destination.hops);
    }
    // Bad registrations, refused by name; the daemon keeps serving.
    let mem = kvwire_transport::HostMem::new("dev-engine-bad", 4096).unwrap();
    let cache = kvwire_client::control::RegisterCache {
        group: "dev-engine-bad".into(),
        model: kvwire_client::control::ModelSource::Toml(scenario::model_toml(&scenario::config())),
        format: "fp32".into(),
        layout: "tp=1,block=16,kv=vllm_nhd".into(),
        rank: 0,
        num_blocks: 8,
        identity: kvwire_core::reuse::CacheIdentity {
            model_digest: "sha256:bad".into(),
            adapter_digest: String::new(),
            format: "fp32/v1".into(),
            tenant: "demo".into(),
            rope: "theta=10000".into(),
            position_offset: 0,
        },
    };
    let memory = kvwire_client::control::DeviceMemory { ordinal: 0, len: 4096, ipc: None };
    let tensor = kvwire_core::tensors::TensorDesc {
        memory: 0,
        offset: 0,
        dtype: "float32".into(),
        shape: vec![2, 8, 16, 4, 32],
        strides: vec![16384, 2048, 128, 32, 1],
        role: kvwire_core::tensors::Role::Kv,
        layers: [0, 1],
    };
    let register = |memories: Vec<kvwire_client::control::DeviceMemory>, fds: &[std::os::fd::BorrowedFd<'_>]| {
        let r = kvwire_client::control::RegisterDeviceTensors { cache: cache.clone(), tensors: vec![tensor.clone()], memories };
        p.cb.register_device_tensors(r, fds).unwrap_err().to_string()
    };
    let e = register(vec![memory.clone(), memory.clone()], &[mem.fd()]);
    assert!(e.contains("1 fds for 2 device memories"), "{e}");
    let e = register(Vec::new(), &[]);
    assert!(e.contains("no device memories"), "{e}");
    let e = register(vec![memory], &[mem.fd()]);
    assert!(e.contains("rank 0: tensor 0") && e.contains("past memory 0's 4096 bytes"), "{e}");
    assert!(run(&p, &Scenario::new("dev-engine-after")).is_ok());
}

/// The real GPU (scripts/gpu-check): with `--features cuda`, `KVWIRE_GPU=1`
/// and a kvwired built with `--features cuda`, caches in CUDA memory move
/// through two daemons over tcp on loopback (the staging path): tinylm's
/// logits, then a 256 MiB cache compared byte for byte, with the daemons'
/// D2H (`stage`) and H2D (`device_complete`) GB/s printed next to
/// cuMemcpyDtoH/HtoD of the same size in the same run.
#[test]
fn gpu_caches_move_through_two_daemons_and_decode_bitwise() {
    const NAME: &str = "gpu_caches_move_through_two_daemons_and_decode_bitwise";
    if std::env::var("KVWIRE_GPU").as_deref() != Ok("1") {
        kvwire_testkit::skip(NAME, kvwire_testkit::Need::Gpu, "KVWIRE_GPU=1 is not set (scripts/gpu-check sets it)");
        return;
    }
    #[cfg(not(feature = "cuda"))]
    panic!("KVWIRE_GPU=1 but {NAME} was built without `--features cuda`");
    #[cfg(feature = "cuda")]
    gpu::run();
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use kvwire_core::reuse::CacheIdentity;
    use kvwire_transport::device::cuda::{export, CudaDevice};
    use kvwire_transport::device::Device;
    use kvwire_transport::HostMem;
    use kvwire_client::control::*;
    use std::os::fd::AsFd;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    const LAYERS: u64 = 8;
    const HEADS: u64 = 8;
    const DIM: u64 = 128;
    const BLOCKS: u32 = 256;

    fn gbps(bytes: u64, ns: u64) -> f64 {
        bytes as f64 / ns.max(1) as f64
    }

    fn hop(st: &TransferStatus, name: &str) -> (u64, u64) {
        st.hops.iter().find(|h| h.hop == name).map(|h| (h.bytes, h.ns)).unwrap_or_else(|| panic!("no `{name}` hop in {:?}", st.hops))
    }

    pub fn run() {
        let d = TempDir::new("e2e-gpu");
        // The daemons must be able to open CUDA: built with `--features cuda`.
        let dev_cfg = "[device]\nbackend = \"cuda\"\n";
        let b = start_daemon(d.path(), "decode-host", SECRET, &[], dev_cfg);
        let a = start_daemon(d.path(), "prefill-host", SECRET, &[("decode-host", &b.peer)], dev_cfg);
        let ca = Client::connect(&a.socket, "prefill").unwrap();
        let cb = Client::connect(&b.socket, "decode").unwrap();
        let p = Pair { _b: b, _a: a, ca, cb, dir: d };

        // 1. tinylm, remapped TP4 NHD/16 → TP2 HND/32, caches in GPU memory.
        let mut sc = Scenario::new("gpu-tinylm");
        sc.memory = scenario::Memory::Cuda;
        let o = super::run(&p, &sc).unwrap();
        assert_bitwise(&o);
        println!("tinylm through two daemons, caches in GPU memory: logits bitwise identical ({} bytes moved)", o.source.bytes);

        // 2. 256 MiB, identity table: bytes compared, copy bandwidth.
        let dev = CudaDevice::open(0).expect("CUDA device 0");
        let spec = format!("name = \"gpu\"\ndtype = \"fp32\"\n[[layers]]\nrepeat = {LAYERS}\nattention = \"dense\"\nkv_heads = {HEADS}\nhead_dim = {DIM}\n");
        let bytes = LAYERS * 2 * u64::from(BLOCKS) * 16 * HEADS * DIM * 4;
        let pattern: Vec<u8> = (0..bytes).map(|i| (i.wrapping_mul(0x9E37_79B9) >> 13) as u8).collect();
        let src = dev.alloc(bytes).unwrap();
        dev.write(&src, 0, &pattern).unwrap();
        let dst = dev.alloc(bytes).unwrap();
        dev.write(&dst, 0, &vec![0u8; bytes as usize]).unwrap();
        let identity = CacheIdentity {
            model_digest: "gpu".into(),
            adapter_digest: String::new(),
            format: "fp32/v1".into(),
            tenant: "t".into(),
            rope: "theta=10000".into(),
            position_offset: 0,
        };
        for (c, group, mem) in [(&p.ca, "gsrc", &src), (&p.cb, "gdst", &dst)] {
            let (dmabuf, ipc) = export(mem).unwrap();
            println!("{group}: dmabuf export {}", if dmabuf.is_some() { "available" } else { "refused by the driver" });
            let r = RegisterCache {
                group: group.into(),
                model: ModelSource::Toml(spec.clone()),
                format: "fp32".into(),
                layout: "tp=1,block=16".into(),
                rank: 0,
                num_blocks: BLOCKS,
                identity: identity.clone(),
            };
            c.register_device(RegisterDeviceCache { cache: r, ordinal: 0, len: bytes, ipc: Some(ipc) }, dmabuf.as_ref().map(|f| f.as_fd())).unwrap();
        }
        let tokens = u64::from(BLOCKS) * 16;
        let table: Vec<u32> = (0..BLOCKS).collect();
        // Twice: the first transfer also pins the source's ring and the
        // destination's mirror; the second finds them pinned, as a serving
        // daemon does. Its hops are the ones reported.
        let mut last = None;
        for round in ["cold", "warm"] {
            dev.write(&dst, 0, &vec![0u8; bytes as usize]).unwrap();
            let dslot = p
                .cb
                .prepare(PrepareReceive { group: "gdst".into(), request: format!("big-{round}"), block_table: table.clone(), tokens, prefix_tokens: 0, source: None })
                .unwrap();
            let t = Instant::now();
            let Submitted { slot: sslot, bytes: moved, .. } = p
                .ca
                .submit(Submit {
                    request: format!("big-src-{round}"),
                    group: "gsrc".into(),
                    block_table: table.clone(),
                    tokens,
                    peer: "decode-host".into(),
                    dst_group: "gdst".into(),
                    dst_request: format!("big-{round}"),
                    codec: None,
                    stream: false,
                })
                .unwrap();
            assert_eq!(moved, bytes);
            p.cb.wait(dslot, FlagName::DecoderUsable, Duration::from_secs(120)).unwrap();
            p.ca.wait(sslot, FlagName::SourceReleased, Duration::from_secs(30)).unwrap();
            let took = t.elapsed();
            let mut got = vec![0u8; bytes as usize];
            dev.read(&dst, 0, &mut got).unwrap();
            assert!(got == pattern, "the destination GPU memory differs from the source ({round})");
            println!("{} MiB through two daemons (tcp loopback, staging path, {round}) in {took:?}, bytes identical", bytes >> 20);
            last = Some((p.ca.status(sslot).unwrap(), p.cb.status(dslot).unwrap()));
        }
        let (ss, ds) = last.unwrap();
        let busy = |st: &TransferStatus| st.hops.iter().filter(|h| h.ns > 0).map(|h| format!("{} {:.1} ms", h.hop, h.ns as f64 / 1e6)).collect::<Vec<_>>().join(", ");
        println!("warm hops, source: {}", busy(&ss));
        println!("warm hops, destination: {}", busy(&ds));
        let (d2h_b, d2h_ns) = hop(&ss, "stage");
        let (h2d_b, h2d_ns) = hop(&ds, "device_complete");
        assert_eq!((d2h_b, h2d_b), (bytes, bytes));

        // Baseline: synchronous cuMemcpyDtoH/HtoD of the same size into pinned memory, same run.
        let host = Arc::new(HostMem::new("baseline", bytes).unwrap());
        let _pin = dev.pin(&host).unwrap();
        dev.copy_d2h_sync(&src, 0, &host, 0, bytes).unwrap(); // warm-up
        let t = Instant::now();
        dev.copy_d2h_sync(&src, 0, &host, 0, bytes).unwrap();
        let d2h_sync = t.elapsed().as_nanos() as u64;
        let t = Instant::now();
        dev.copy_h2d_sync(&host, 0, &dst, 0, bytes).unwrap();
        let h2d_sync = t.elapsed().as_nanos() as u64;
        println!(
            "D2H daemon stage: {:.2} GB/s; cuMemcpyDtoH: {:.2} GB/s; ratio {:.2}",
            gbps(d2h_b, d2h_ns),
            gbps(bytes, d2h_sync),
            gbps(d2h_b, d2h_ns) / gbps(bytes, d2h_sync)
        );
        println!(
            "H2D daemon device_complete: {:.2} GB/s; cuMemcpyHtoD: {:.2} GB/s; ratio {:.2}",
            gbps(h2d_b, h2d_ns),
            gbps(bytes, h2d_sync),
            gbps(h2d_b, h2d_ns) / gbps(bytes, h2d_sync)
        );
    }
}

/// The status of `c`'s source transfer once it ended: the destination may
/// hear of a failure (the source's `Abort`) before the source's own status says it.
fn source_ended(c: &Client) -> kvwire_client::control::TransferStatus {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let s = (0..8).filter_map(|i| c.status(i).ok()).find(|s| s.role == "source");
        if let Some(s) = s.filter(|s| s.state != kvwire_client::control::TransferState::Running) {
            return s;
        }
        assert!(std::time::Instant::now() < deadline, "the source transfer never ended");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_failing_device_copy_fails_the_transfer_by_name_and_publishes_no_layer() {
    let _shared = crate::shared();
    let d = TempDir::new("e2e-device-fail");
    let dev = "[device]\nbackend = \"host\"\n";
    // The destination's first host → device copy fails (layer 0's).
    let b = start_daemon(d.path(), "decode-host", SECRET, &[], &format!("{dev}standin_fail_copy = 0\n"));
    let a = start_daemon(d.path(), "prefill-host", SECRET, &[("decode-host", &b.peer)], dev);
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let p = Pair { _b: b, _a: a, ca, cb, dir: d };
    let mut sc = Scenario::new("h2d-fails");
    sc.memory = scenario::Memory::StandIn;
    match run(&p, &sc) {
        Err(ScenarioError::Daemon { step, source }) => assert!(step.starts_with("wait"), "{step}: {source}"),
        Err(e) => panic!("unexpected: {e}"),
        Ok(_) => panic!("a transfer whose host → device copy failed completed"),
    }
    let slot = (0..4).find(|&s| p.cb.status(s).is_ok()).expect("the destination's slot");
    let st = p.cb.status(slot).unwrap();
    let err = st.error.clone().unwrap_or_default();
    assert!(err.contains("host → device copy") && err.contains("layer 0"), "{err}");
    // The bytes all arrived in the host mirror, yet no layer is usable on the device.
    for l in 0..4 {
        assert!(!p.cb.ready(slot, FlagName::LayerReady(l)), "layer_ready({l}) published after a failed device copy");
    }
    assert!(!p.cb.ready(slot, FlagName::DecoderUsable));

    // A source of its own whose stand-in device fails its copy number
    // `n`: its transfer into the same decode daemon fails after the
    // submit (its copies run layer by layer on the transfer thread). Its
    // client, and its transfer's status once ended.
    let failing_source = |node: &str, name: &str, n: u64, more: &str| {
        let extra = format!("{dev}standin_fail_copy = {n}\nstandin_delay_ms = 1\n{more}");
        let a = start_daemon(p.dir.path(), node, SECRET, &[("decode-host", &p._b.peer)], &extra);
        let c = Client::connect(&a.socket, node).unwrap();
        let mut sc = Scenario::new(name);
        sc.memory = scenario::Memory::StandIn;
        match scenario::run(&c, &p.cb, "decode-host", &sc) {
            Err(ScenarioError::Daemon { step, source }) => assert!(step.starts_with("wait"), "{name}: {step}: {source}"),
            Err(e) => panic!("{name}: unexpected: {e}"),
            Ok(_) => panic!("{name}: a transfer whose device → host copy failed completed"),
        }
        let st = source_ended(&c);
        assert_eq!(st.state, kvwire_client::control::TransferState::Failed, "{name}: {st:?}");
        (a, c, st)
    };
    // The first copy: the transfer fails naming layer 0, and nothing is released.
    let (_a2, ca2, st) = failing_source("prefill-two", "d2h-fails", 0, "");
    let err = st.error.clone().unwrap_or_default();
    assert!(err.contains("device → host staging of layer 0"), "{err}");
    assert!(!ca2.ready(st.slot, FlagName::SourceReleased), "released after a failed device copy");

    // Mid-transfer: a later copy fails (each layer takes a few dozen: a
    // copy per run of a rank's shuffled blocks) while earlier layers are
    // already out. The transfer fails naming that layer, which is never
    // published, nor any after it.
    // The same read in place (GPUDirect): the failed layer's writes went
    // out before its copies, but without the checksums that copy gives
    // the destination never publishes it.
    for (node, name, more) in [("prefill-three", "d2h-fails-mid", ""), ("prefill-four", "d2h-fails-in-place", "gpudirect = \"on\"\n")] {
        let (_a3, ca3, st) = failing_source(node, name, 40, more);
        let err = st.error.clone().unwrap_or_default();
        let failed: u16 = err.split("device → host staging of layer ").nth(1).and_then(|r| r.split(':').next()?.parse().ok()).unwrap_or_else(|| panic!("{name}: no layer named: {err}"));
        assert!(failed >= 1, "{name}: the injected copy is not past layer 0: {err}");
        let staged = |l: u16| st.marks.iter().any(|m| m.name == format!("host_staged({l})"));
        assert!((0..failed).all(staged) && !staged(failed), "{name}: {:?}", st.marks);
        // Mid-ring: every earlier layer left the wire; the ring's copies
        // never all completed, so the source was never released.
        let sent = |l: u16| st.marks.iter().any(|m| m.name == format!("sent({l})"));
        assert!((0..failed).all(sent) && !sent(failed), "{name}: {:?}", st.marks);
        assert!(!ca3.ready(st.slot, FlagName::SourceReleased), "{name}: released after a failed device copy");
        let dslot = (0..8).filter(|&s| p.cb.status(s).is_ok_and(|d| d.request == format!("{name}-req"))).last().expect("the destination's slot");
        for l in failed..4 {
            assert!(!p.cb.ready(dslot, FlagName::LayerReady(l)), "{name}: layer_ready({l}) published after the source failed at layer {failed}");
        }
        assert!(!p.cb.ready(dslot, FlagName::DecoderUsable));
    }
}

#[test]
fn device_resident_caches_remap_over_shm_as_strided_writes() {
    let _shared = crate::shared();
    // Over shm a remap's segments go as strided writes, straight into
    // place: from the source's ring slot (which holds each one's whole
    // span, so its runs keep their stride) or, read in place, from the
    // stand-in's device memory; mixed with host ranks too.
    let dev = "[device]\nbackend = \"host\"\n";
    for gpudirect in ["off", "on"] {
        let name = format!("shm-strided-{gpudirect}");
        let p = pair_with(&name, &format!("[transport]\nkind = \"shm\"\n{dev}gpudirect = \"{gpudirect}\"\n"), &format!("[transport]\nkind = \"shm\"\n{dev}"));
        for (what, memory) in [("device", scenario::Memory::StandIn), ("mixed", scenario::Memory::Mixed)] {
            // As in the pricing test: 136 KiB segments, 4 KiB runs back to back at the destination.
            let mut sc = Scenario::new(&format!("{name}-{what}"));
            sc.memory = memory;
            sc.tokens = 1088;
            sc.src_layout = "tp=4,block=16,layout=nhd".into();
            sc.dst_layout = "tp=2,block=32,layout=hnd".into();
            let o = run(&p, &sc).unwrap();
            assert_bitwise(&o);
            assert_eq!(hop(&o.destination, "unpack"), None, "{name} {what}: {:?}", o.destination.hops);
            if gpudirect == "on" {
                assert!(o.source.in_place_bytes > 0, "{name} {what}: {:?}", o.source);
            }
        }
    }
}
