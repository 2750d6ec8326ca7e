//! Two real kvwired processes on loopback: registration over the control
//! socket with memfds, an authenticated peer handshake, a remapped transfer
//! checked byte for byte, and the failure paths.

use kvwire_core::layout::{from_toml_spec, ModelSpec};
use kvwire_core::plan::{Buffers, Side};
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::shard::LayoutSpec;
use kvwire_core::{verify, CacheFormat};
use kvwire_transport::HostMem;
use kvwire_client::client::{Client, ClientError, Submitted};
use kvwire_client::control::*;
use kvwire_testkit::{counter, start_daemon, DaemonProc, TempDir};
use std::time::Duration;

pub(crate) const MODEL: &str = "name = \"toy\"\ndtype = \"bf16\"\n[[layers]]\nrepeat = 4\nattention = \"dense\"\nkv_heads = 4\nhead_dim = 16\n";
pub(crate) const WAIT: Duration = Duration::from_secs(20);

/// kvwired `node` on loopback, its files in `dir`, with static `peers`.
fn start(dir: &TempDir, node: &str, secret: &str, peers: &[(&str, &str)]) -> DaemonProc {
    start_daemon(dir.path(), node, secret, peers, "")
}

fn identity() -> CacheIdentity {
    identity_of("toy-digest", "t1")
}

pub(crate) fn identity_of(model_digest: &str, tenant: &str) -> CacheIdentity {
    CacheIdentity {
        model_digest: model_digest.into(),
        adapter_digest: String::new(),
        format: "bf16/v1".into(),
        tenant: tenant.into(),
        rope: "theta=10000".into(),
        position_offset: 0,
    }
}

/// One side of a test transfer: its layout resolved, and one memfd per rank.
pub(crate) struct Side_ {
    pub(crate) side: Side,
    pub(crate) mems: Vec<HostMem>,
}

pub(crate) fn model() -> ModelSpec {
    from_toml_spec("toy", MODEL).unwrap()
}

pub(crate) fn side(layout: &str, tokens: u64) -> Side {
    Side::new(&model(), &LayoutSpec::parse(layout).unwrap(), CacheFormat::parse("bf16").unwrap(), tokens).unwrap()
}

/// Registers every rank of `layout` as group `group`, filled from `bufs` (or zero).
pub(crate) fn register(c: &Client, group: &str, layout: &str, s: &Side, bufs: Option<&Buffers>, id: CacheIdentity) -> Side_ {
    register_by(|r, mem| c.register(r, mem).unwrap(), group, layout, s, bufs, id)
}

/// [`register`], each rank's registration made by `registers` (the
/// daemon's answer: regions, bytes, whether the group is complete).
pub(crate) fn register_by(mut registers: impl FnMut(RegisterCache, &HostMem) -> (u32, u64, bool), group: &str, layout: &str, s: &Side, bufs: Option<&Buffers>, id: CacheIdentity) -> Side_ {
    let m = model();
    let mut mems = Vec::new();
    for rank in 0..s.shard.ranks.len() as u32 {
        let regions = s.regions(&m, rank);
        let total: u64 = regions.iter().map(|(_, l)| l).sum();
        let mem = HostMem::new("test-rank", total).unwrap();
        let mut off = 0;
        for (id, len) in &regions {
            if let Some(b) = bufs {
                mem.write(off, &b.ranks[rank as usize][id]).unwrap();
            }
            off += len;
        }
        let r = RegisterCache {
            group: group.into(),
            model: ModelSource::Toml(MODEL.into()),
            format: "bf16".into(),
            layout: layout.into(),
            rank,
            num_blocks: s.num_blocks,
            identity: id.clone(),
        };
        let (n, bytes, complete) = registers(r, &mem);
        assert_eq!((n as usize, bytes), (regions.len(), total));
        assert_eq!(complete, rank as usize == s.shard.ranks.len() - 1);
        mems.push(mem);
    }
    Side_ { side: s.clone(), mems }
}

/// Canary in every byte of `s`'s memfds: a byte no transfer wrote shows.
pub(crate) fn canary(s: &Side_) {
    for m in &s.mems {
        m.write(0, &vec![verify::CANARY; m.len() as usize]).unwrap();
    }
}

/// What the destination's memfds hold, as Buffers.
pub(crate) fn read_back(s: &Side_) -> Buffers {
    let m = model();
    let mut out = Buffers::alloc(&m, &s.side, 0);
    for (rank, mem) in s.mems.iter().enumerate() {
        let mut off = 0;
        for (id, len) in s.side.regions(&m, rank as u32) {
            let buf = out.ranks[rank].get_mut(&id).unwrap();
            mem.read(off, buf).unwrap();
            off += len;
        }
    }
    out
}

/// Submits group `prefill` to peer `b`'s request `dst_request` in group `decode`.
fn submit(c: &Client, s: &Side, tokens: u64, dst_request: &str) -> Result<Submitted, ClientError> {
    submit_to(c, "b", s, tokens, dst_request)
}

/// Submits group `prefill` to `peer`'s request `dst_request` in group `decode`.
pub(crate) fn submit_to(c: &Client, peer: &str, s: &Side, tokens: u64, dst_request: &str) -> Result<Submitted, ClientError> {
    c.submit(Submit {
        request: format!("p-{dst_request}"),
        group: "prefill".into(),
        block_table: s.block_table.clone(),
        tokens,
        peer: peer.into(),
        dst_group: "decode".into(),
        dst_request: dst_request.into(),
        codec: None,
        stream: false,
    })
}

pub(crate) const SRC: &str = "tp=4,block=16,layout=nhd,table=shuffle:5";
pub(crate) const DST: &str = "tp=2,block=32,layout=hnd,table=shuffle:9";

#[test]
fn remapped_transfer_between_two_daemons_is_exact() {
    let dir = TempDir::new("remap");
    let b = start(&dir, "b", "a-secret-of-at-least-16-bytes", &[]);
    let a = start(&dir, "a", "a-secret-of-at-least-16-bytes", &[("b", &b.peer)]);
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let tokens = 100; // partial final block on both sides
    let (ss, ds) = (side(SRC, tokens), side(DST, tokens));
    let src_bytes = verify::fill_source(&model(), &ss, tokens);
    let src = register(&ca, "prefill", SRC, &ss, Some(&src_bytes), identity());
    let dst = register(&cb, "decode", DST, &ds, None, identity());
    // Canary everywhere at the destination first.
    canary(&dst);
    let slot = cb
        .prepare(PrepareReceive { group: "decode".into(), request: "r1".into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: None })
        .unwrap();
    let Submitted { slot: sslot, peer_slot, bytes, .. } = submit(&ca, &ss, tokens, "r1").unwrap();
    assert_eq!(peer_slot, slot);
    assert_eq!(bytes, 4 /*layers*/ * 4 /*kv heads*/ * 16 * 2 /*K,V*/ * 2 /*bf16*/ * tokens);
    for layer in 0..4 {
        cb.wait(slot, FlagName::LayerReady(layer), WAIT).unwrap();
    }
    cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
    ca.wait(sslot, FlagName::SourceReleased, WAIT).unwrap();
    // The source is done when the destination says so: its decoder_usable.
    ca.wait(sslot, FlagName::DecoderUsable, WAIT).unwrap();
    let want = verify::expected_destination(&model(), &ds, tokens, 0);
    assert!(read_back(&dst) == want, "destination bytes differ from the independent expectation");
    assert_eq!(cb.status(slot).unwrap().state, TransferState::Done);
    assert_eq!(ca.status(sslot).unwrap().state, TransferState::Done);
    let stats = ca.stats().unwrap();
    assert!(stats.contains(&format!("kvwire_payload_bytes_total{{node=\"a\"}} {bytes}")), "{stats}");
    // Per-peer hop histograms: the source timed its wire hop toward `b`.
    assert!(stats.contains("kvwire_peer_hop_seconds_count{node=\"a\",peer=\"b\",hop=\"wire\"} 1"), "{stats}");
    // One sample of `post` and one of `wire` for the transfer, however
    // many batches it posted: not the data connections' own as well.
    for hop in ["post", "wire"] {
        assert!(stats.contains(&format!("kvwire_hop_seconds_count{{node=\"a\",hop=\"{hop}\"}} 1\n")), "{hop}: {stats}");
    }
    check_hop_quantiles(&stats);
    check_hop_quantiles(&cb.stats().unwrap());

    // `notify` is the clients' waits and nothing else: a's waits on
    // source_released and decoder_usable, b's four layer_ready and one
    // decoder_usable (read on the mapped page, sent with the next call);
    // then one wait through the control socket.
    assert_eq!(notify_count(&ca), 2);
    assert_eq!(notify_count(&cb), 5);
    let r = cb.call(&Request::Wait { slot, flag: FlagName::DecoderUsable, timeout_ms: 1000 }, &[]).unwrap();
    assert!(matches!(r, Reply::Waited { .. }), "{r:?}");
    assert_eq!(notify_count(&cb), 6);
    drop(src);
}

fn notify_count(c: &Client) -> u64 {
    let st = kvwire_client::promtext::Stats::from_text(&c.stats().unwrap()).unwrap();
    st.hops.iter().find(|h| h.hop == "notify").unwrap().count
}

/// What `kvwire stats` reads from a live daemon: every hop with samples has
/// the histogram's own quantiles, in order, none above the max nor the max
/// below the mean; a hop with one sample has that sample (its sum) for each.
fn check_hop_quantiles(text: &str) {
    let st = kvwire_client::promtext::Stats::from_text(text).unwrap();
    let timed: Vec<_> = st.hops.iter().filter(|h| h.count > 0).collect();
    assert!(timed.iter().any(|h| h.hop == "wire" || h.hop == "place"), "no wire or place samples:\n{text}");
    for h in timed {
        assert_eq!(h.latency_from, kvwire_client::promtext::LatencyFrom::Histogram, "{h:?}");
        let q = [h.p50_seconds, h.p90_seconds, h.p99_seconds, h.p999_seconds, h.max_seconds].map(|v| v.unwrap_or_else(|| panic!("{h:?}")));
        assert!(q.windows(2).all(|w| w[0] <= w[1]), "quantiles out of order: {h:?}");
        let mean = h.mean_seconds.unwrap();
        // The max is at or above the mean (to hdrhistogram's 0.1%).
        assert!(q[4] >= mean * (1.0 - 1e-3), "max below the mean: {h:?}");
        if h.count == 1 {
            assert!(q.iter().all(|&v| v >= h.sum_seconds && (v - h.sum_seconds) <= h.sum_seconds * 1e-3 + 1e-9), "one sample: {h:?}");
        }
    }
}

#[test]
fn wrong_secret_is_refused_and_the_daemon_keeps_serving() {
    let dir = TempDir::new("secret");
    let b = start(&dir, "b", "the-real-shared-secret", &[]);
    let a = start(&dir, "a", "a-different-secret-value", &[("b", &b.peer)]);
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let tokens = 20;
    let (ss, ds) = (side(SRC, tokens), side(DST, tokens));
    let _src = register(&ca, "prefill", SRC, &ss, None, identity());
    let _dst = register(&cb, "decode", DST, &ds, None, identity());
    cb.prepare(PrepareReceive { group: "decode".into(), request: "r".into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: None })
        .unwrap();
    let e = submit(&ca, &ss, tokens, "r").unwrap_err();
    assert!(matches!(&e, ClientError::Daemon { code: 202, .. }), "{e}");
    assert!(e.to_string().contains("secret"), "{e}");
    assert!(cb.stats().unwrap().contains("kvwire_refused_total{node=\"b\",who=\"peer\"} 1"));
}

#[test]
fn identity_mismatch_is_refused_by_field() {
    let dir = TempDir::new("ident");
    let b = start(&dir, "b", "a-secret-of-at-least-16-bytes", &[]);
    let a = start(&dir, "a", "a-secret-of-at-least-16-bytes", &[("b", &b.peer)]);
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let tokens = 20;
    let (ss, ds) = (side(SRC, tokens), side(DST, tokens));
    let other = CacheIdentity { adapter_digest: "lora-7".into(), ..identity() };
    let _src = register(&ca, "prefill", SRC, &ss, None, other);
    let _dst = register(&cb, "decode", DST, &ds, None, identity());
    let slot = cb
        .prepare(PrepareReceive { group: "decode".into(), request: "r".into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: None })
        .unwrap();
    let e = submit(&ca, &ss, tokens, "r").unwrap_err();
    assert!(e.to_string().contains("adapter digest mismatch"), "{e}");
    assert!(!cb.ready(slot, FlagName::DecoderUsable));
    // The decode side hears it at once: its prepared receive failed with
    // the reason, and a wait on it ends instead of running to its timeout.
    let st = cb.status(slot).unwrap();
    assert_eq!(st.state, TransferState::Failed, "{st:?}");
    let why = st.error.unwrap_or_default();
    assert!(why.contains("adapter digest mismatch") && why.contains("refused the offer of `a`"), "{why}");
    let started = std::time::Instant::now();
    let e = cb.wait(slot, FlagName::DecoderUsable, std::time::Duration::from_secs(30)).unwrap_err();
    assert!(e.to_string().contains("failed"), "{e}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "the wait ran to its timeout");
}

#[test]
fn malformed_control_messages_get_errors_and_the_daemon_keeps_serving() {
    use std::io::{Read, Write};
    let dir = TempDir::new("malformed");
    let b = start(&dir, "b", "a-secret-of-at-least-16-bytes", &[]);
    let mut raw = std::os::unix::net::UnixStream::connect(&b.socket).unwrap();
    let body = b"{\"op\":\"no_such_op\"}";
    raw.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    raw.write_all(body).unwrap();
    let mut len = [0u8; 4];
    raw.read_exact(&mut len).unwrap();
    let mut reply = vec![0u8; u32::from_le_bytes(len) as usize];
    raw.read_exact(&mut reply).unwrap();
    let reply = String::from_utf8(reply).unwrap();
    assert!(reply.contains("\"code\":100"), "{reply}");
    // Same connection still answers a good request.
    let body = b"{\"op\":\"status\",\"slot\":3}";
    raw.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    raw.write_all(body).unwrap();
    raw.read_exact(&mut len).unwrap();
    let mut reply = vec![0u8; u32::from_le_bytes(len) as usize];
    raw.read_exact(&mut reply).unwrap();
    assert!(String::from_utf8(reply).unwrap().contains("\"code\":105"));
    // A huge length closes that connection only.
    raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
    // Bad registrations are answered by name.
    let c = Client::connect(&b.socket, "x").unwrap();
    let mem = HostMem::new("small", 64).unwrap();
    let r = RegisterCache {
        group: "g".into(),
        model: ModelSource::Toml(MODEL.into()),
        format: "bf16".into(),
        layout: "tp=2".into(),
        rank: 0,
        num_blocks: 4,
        identity: identity(),
    };
    let e = c.register(r.clone(), &mem).unwrap_err();
    assert!(matches!(&e, ClientError::Daemon { code: 103, .. }) && e.to_string().contains("need"), "{e}");
    let e = c.register(RegisterCache { layout: "tp=3".into(), ..r.clone() }, &mem).unwrap_err();
    assert!(e.to_string().contains("tp=3"), "{e}");
    // Device memory on a daemon without a device backend: refused, naming the setting.
    let e = c.register_device(RegisterDeviceCache { cache: r.clone(), ordinal: 0, len: 64, ipc: None }, Some(mem.fd())).unwrap_err();
    assert!(matches!(&e, ClientError::Daemon { code: 103, .. }) && e.to_string().contains("[device] backend"), "{e}");
    let e = c.register(RegisterCache { model: ModelSource::Builtin("nope".into()), ..r }, &mem).unwrap_err();
    assert!(matches!(&e, ClientError::Daemon { code: 101, .. }), "{e}");
    assert!(Client::connect(&b.socket, "y").is_ok());
}

#[test]
fn bad_device_registrations_are_refused_by_name_and_nothing_is_kept() {
    let dir = TempDir::new("device-bad");
    let b = start_daemon(dir.path(), "b", "a-secret-of-at-least-16-bytes", &[], "[device]\nbackend = \"host\"\n");
    let c = Client::connect(&b.socket, "x").unwrap();
    let s = side(SRC, 32);
    let need: u64 = s.regions(&model(), 0).iter().map(|(_, l)| l).sum();
    let r = RegisterCache {
        group: "g".into(),
        model: ModelSource::Toml(MODEL.into()),
        format: "bf16".into(),
        layout: SRC.into(),
        rank: 0,
        num_blocks: s.num_blocks,
        identity: identity(),
    };
    let dev = HostMem::new("device", need).unwrap();
    let reg = |len: u64, ordinal: u32, fd: bool| {
        c.register_device(RegisterDeviceCache { cache: r.clone(), ordinal, len, ipc: None }, fd.then(|| dev.fd()))
    };
    // Less than the rank's regions need, a device this daemon does not
    // serve, a stand-in allocation whose fd is missing or of another size.
    let e = reg(need - 1, 0, true).unwrap_err();
    assert!(e.to_string().contains("regions need"), "{e}");
    let e = reg(need, 1, true).unwrap_err();
    assert!(e.to_string().contains("device 1"), "{e}");
    let e = reg(need, 0, false).unwrap_err();
    assert!(e.to_string().contains("fd"), "{e}");
    let e = reg(need + 4096, 0, true).unwrap_err();
    assert!(e.to_string().contains("device allocation"), "{e}");
    // None of it was kept: the good registration still goes through.
    let (regions, bytes, _) = reg(need, 0, true).unwrap();
    assert_eq!(bytes, need);
    assert!(regions > 0);
    // A backend the daemon does not know stops it, named.
    let cfg = kvwired::config::Config { device: kvwired::config::DeviceConfig { backend: "tpu".into(), ..Default::default() }, ..Default::default() };
    assert!(cfg.validate().unwrap_err().to_string().contains("device.backend"));
    // So does a GPUDirect mode it does not know.
    let cfg = kvwired::config::Config { device: kvwired::config::DeviceConfig { gpudirect: "always".into(), ..Default::default() }, ..Default::default() };
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("device.gpudirect") && e.contains("auto, on or off"), "{e}");
}

fn denied(r: Result<impl std::fmt::Debug, ClientError>, what: &str) {
    match r {
        Err(ClientError::Daemon { code: 400, message }) => assert!(message.contains("another client") || message.contains("no rank of"), "{what}: {message}"),
        other => panic!("{what}: expected permission denied (400), got {other:?}"),
    }
}

fn limit(r: Result<impl std::fmt::Debug, ClientError>, key: &str) {
    match r {
        Err(ClientError::Daemon { code: 108, message }) => assert!(message.contains(key), "{message}"),
        other => panic!("expected {key} (108), got {other:?}"),
    }
}

/// Moves group `prefill` into request `request` of group `decode` and checks every destination byte.
fn transfer_exact(ca: &Client, cb: &Client, ss: &Side, ds: &Side, dst: &Side_, tokens: u64, request: &str) {
    canary(dst);
    let slot = cb
        .prepare(PrepareReceive { group: "decode".into(), request: request.into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: None })
        .unwrap();
    let sslot = submit(ca, ss, tokens, request).unwrap().slot;
    cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
    ca.wait(sslot, FlagName::SourceReleased, WAIT).unwrap();
    assert!(read_back(dst) == verify::expected_destination(&model(), ds, tokens, 0), "destination bytes differ");
}

#[test]
fn a_client_touches_only_the_groups_and_transfers_it_registered() {
    let dir = TempDir::new("scope");
    let b = start(&dir, "b", "a-secret-of-at-least-16-bytes", &[]);
    let a = start(&dir, "a", "a-secret-of-at-least-16-bytes", &[("b", &b.peer)]);
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    // Same uid, so the socket lets them in; only their own registrations are theirs.
    let xa = Client::connect(&a.socket, "intruder").unwrap();
    let xb = Client::connect(&b.socket, "intruder").unwrap();
    let tokens = 40;
    let (ss, ds) = (side(SRC, tokens), side(DST, tokens));
    let src_bytes = verify::fill_source(&model(), &ss, tokens);
    let _src = register(&ca, "prefill", SRC, &ss, Some(&src_bytes), identity());
    let dst = register(&cb, "decode", DST, &ds, None, identity());

    denied(xb.release("decode", 0), "release of another client's rank");
    let prep = PrepareReceive { group: "decode".into(), request: "x".into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: None };
    denied(xb.prepare(prep.clone()), "prepare into another client's group");
    denied(submit(&xa, &ss, tokens, "x"), "submit of another client's group");
    let slot = cb.prepare(prep).unwrap();
    denied(xb.status(slot), "status of another client's transfer");
    denied(xb.cancel(slot), "cancel of another client's transfer");
    let wait = Request::Wait { slot, flag: FlagName::DecoderUsable, timeout_ms: 10 };
    denied(xb.call(&wait, &[]), "wait on another client's transfer");
    // The intruder's own cache is its own: it may register a group of its own name.
    let own = HostMem::new("own", dst.mems[0].len()).unwrap();
    let r = RegisterCache {
        group: "intruder".into(),
        model: ModelSource::Toml(MODEL.into()),
        format: "bf16".into(),
        layout: DST.into(),
        rank: 0,
        num_blocks: ds.num_blocks,
        identity: identity(),
    };
    xb.register(r, &own).unwrap();
    // Nothing of the owners' was touched: the prepared slot still waits and
    // the transfer into it is exact.
    assert_eq!(cb.status(slot).unwrap().state, TransferState::Prepared);
    cb.cancel(slot).unwrap();
    transfer_exact(&ca, &cb, &ss, &ds, &dst, tokens, "r");
}

#[test]
fn a_peer_may_name_only_the_transfers_of_its_own_connection() {
    use kvwired::peer::{connect_auth, PeerMsg, Sealed};
    let dir = TempDir::new("peerscope");
    let b = start(&dir, "b", "a-secret-of-at-least-16-bytes", &[]);
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let tokens = 20;
    let ds = side(DST, tokens);
    let _dst = register(&cb, "decode", DST, &ds, None, identity());
    let slot = cb
        .prepare(PrepareReceive { group: "decode".into(), request: "r".into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: None })
        .unwrap();
    // An authenticated peer that never offered anything.
    let mut s = std::net::TcpStream::connect(&b.peer).unwrap();
    let (_, cred) = connect_auth(&mut s, b"a-secret-of-at-least-16-bytes", "a").unwrap();
    let mut s = Sealed::new(s, cred, true);
    // A verdict is the destination's word: one from a source is refused.
    for (m, why) in [(PeerMsg::Abort { slot, reason: "hostile".into() }, "not a transfer of this connection"), (PeerMsg::Verdict { slot, error: None }, "unexpected verdict")] {
        s.send(&m).unwrap();
        match s.recv().unwrap() {
            PeerMsg::Refused { reason } => assert!(reason.contains(why), "{reason}"),
            other => panic!("{other:?}"),
        }
    }
    drop(s);
    assert_eq!(cb.status(slot).unwrap().state, TransferState::Prepared);
    assert!(!cb.ready(slot, FlagName::DecoderUsable));
}

#[test]
fn limits_are_enforced_by_name_and_what_is_registered_keeps_working() {
    let dir = TempDir::new("limits");
    let tokens = 30;
    let (ss, ds) = (side(SRC, tokens), side(DST, tokens));
    // One DST group: 2 ranks of 4 layers x (K, V) = 16 regions.
    let group_bytes: u64 = (0..2).flat_map(|r| ds.regions(&model(), r)).map(|(_, l)| l).sum();
    let b = start_daemon(
        dir.path(),
        "b",
        "a-secret-of-at-least-16-bytes",
        &[],
        &format!("[limits]\nmax_regions = 24\nmax_inflight_transfers = 2\nmax_memory_bytes = {}\n", group_bytes * 5 / 2),
    );
    let a = start(&dir, "a", "a-secret-of-at-least-16-bytes", &[("b", &b.peer)]);
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let src_bytes = verify::fill_source(&model(), &ss, tokens);
    let _src = register(&ca, "prefill", SRC, &ss, Some(&src_bytes), identity());
    let dst = register(&cb, "decode", DST, &ds, None, identity());

    let rank_bytes: u64 = ds.regions(&model(), 0).iter().map(|(_, l)| l).sum();
    let reg = |group: &str, len: u64| {
        let mem = HostMem::new("extra", len).unwrap();
        let r = RegisterCache {
            group: group.into(),
            model: ModelSource::Toml(MODEL.into()),
            format: "bf16".into(),
            layout: DST.into(),
            rank: 0,
            num_blocks: ds.num_blocks,
            identity: identity(),
        };
        cb.register(r, &mem)
    };
    // 16 + 8 regions fit; 8 more do not.
    reg("second", rank_bytes).unwrap();
    limit(reg("third", rank_bytes), "limits.max_regions");
    // Memory: a memfd far larger than its regions still counts whole.
    limit(reg("fat", group_bytes * 2), "limits.max_memory_bytes");
    // Two receives in flight, not three.
    let prep = |request: &str| {
        cb.prepare(PrepareReceive { group: "decode".into(), request: request.into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: None })
    };
    let s1 = prep("p1").unwrap();
    let _s2 = prep("p2").unwrap();
    limit(prep("p3"), "limits.max_inflight_transfers");
    cb.cancel(s1).unwrap();
    cb.cancel(_s2).unwrap();
    // The refusals cost nothing already registered: a transfer is exact.
    transfer_exact(&ca, &cb, &ss, &ds, &dst, tokens, "after");
}

#[test]
fn a_source_keeping_no_connections_opens_its_own_for_each_transfer() {
    // `limits.peer_connections_kept = 0` at the source: each transfer opens
    // a peer connection and a data connection and closes them when it
    // ends; the next one neither finds one nor waits for one.
    let tokens = 100;
    let Pair { ca, cb, ss, ds, dst, .. } = &pair_with("keep-none", "[limits]\npeer_connections_kept = 0\n", "", tokens);
    for request in ["k1", "k2", "k3"] {
        transfer_exact(ca, cb, ss, ds, dst, tokens, request);
    }
    let sa = ca.stats().unwrap();
    let conns = |metric: &str, how: &str| counter(&sa, metric, "a", &format!("how=\"{how}\""));
    assert_eq!((conns("kvwire_peer_connections_total", "opened"), conns("kvwire_peer_connections_total", "reused")), (3, 0), "{sa}");
    assert_eq!((conns("kvwire_data_connections_total", "opened"), conns("kvwire_data_connections_total", "reused")), (3, 0), "{sa}");
}

/// A count of `kvwire_starts_total` in `stats`.
fn starts(stats: &str, node: &str, how: &str) -> u64 {
    counter(stats, "kvwire_starts_total", node, &format!("how=\"{how}\""))
}

/// Daemon `a` sending to daemon `b` (started with config `b_extra`), a
/// client of each, and `tokens` of the test model registered: the source
/// filled, the destination zero. Clients go before daemons, daemons
/// before their directory.
struct Pair {
    ca: Client,
    cb: Client,
    ss: Side,
    ds: Side,
    _src: Side_,
    dst: Side_,
    _a: DaemonProc,
    _b: DaemonProc,
    _dir: TempDir,
}

fn pair(name: &str, b_extra: &str, tokens: u64) -> Pair {
    pair_with(name, "", b_extra, tokens)
}

/// [`pair`], with `a` started with config `a_extra` too.
fn pair_with(name: &str, a_extra: &str, b_extra: &str, tokens: u64) -> Pair {
    let dir = TempDir::new(name);
    let b = start_daemon(dir.path(), "b", "a-secret-of-at-least-16-bytes", &[], b_extra);
    let a = start_daemon(dir.path(), "a", "a-secret-of-at-least-16-bytes", &[("b", &b.peer)], a_extra);
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let (ss, ds) = (side(SRC, tokens), side(DST, tokens));
    let src_bytes = verify::fill_source(&model(), &ss, tokens);
    let _src = register(&ca, "prefill", SRC, &ss, Some(&src_bytes), identity());
    let dst = register(&cb, "decode", DST, &ds, None, identity());
    Pair { ca, cb, ss, ds, _src, dst, _a: a, _b: b, _dir: dir }
}

#[test]
fn a_receive_announced_to_its_source_is_claimed_with_no_round_trip_or_falls_back_to_the_offer() {
    let tokens = 100;
    let Pair { ca, cb, ss, ds, dst, .. } = &pair("announce", "", tokens);
    let canary = || canary(dst);
    let prepare = |request: &str, tokens: u64| {
        let p = PrepareReceive { group: "decode".into(), request: request.into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: Some("a".into()) };
        cb.prepare_announced(p).unwrap()
    };
    let moved = |slot: u16, request: &str| {
        let sslot = submit(&ca, &ss, tokens, request).unwrap().slot;
        cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
        ca.wait(sslot, FlagName::DecoderUsable, WAIT).unwrap();
        assert!(read_back(&dst) == verify::expected_destination(&model(), &ds, tokens, 0), "destination bytes differ ({request})");
        // Both sides count the same crossing, the announcement included.
        let (src, dst) = (ca.status(sslot).unwrap().wire_bytes, cb.status(slot).unwrap().wire_bytes);
        assert_eq!(src, dst, "{request}: the source's wire_bytes against the destination's");
    };

    // `a` has no connection here yet: nothing to announce on, so it offers.
    canary();
    let (slot, told) = prepare("r1", tokens);
    let why = told.expect("the prepare named a source").expect_err("announced with no connection");
    assert!(why.contains("no connection from `a`"), "{why}");
    moved(slot, "r1");
    // Its connection is idle here now: the next receive is announced, and
    // the submit claims it.
    canary();
    let (slot, told) = prepare("r2", tokens);
    assert_eq!(told, Some(Ok(())));
    moved(slot, "r2");
    let (sa, sb) = (ca.stats().unwrap(), cb.stats().unwrap());
    assert_eq!((starts(&sa, "a", "offered"), starts(&sa, "a", "claimed"), starts(&sb, "b", "announced")), (1, 1, 1));
    // One peer connection, opened for the first and kept for the second.
    let conns = |how: &str| counter(&sa, "kvwire_peer_connections_total", "a", &format!("how=\"{how}\""));
    assert_eq!((conns("opened"), conns("reused")), (1, 1));

    // Announced for another token count: the source sees it will not fit
    // and offers instead, and hears why from the destination, whose
    // prepared receive fails with it.
    let (slot, told) = prepare("r3", tokens + 1);
    assert_eq!(told, Some(Ok(())));
    let e = submit(&ca, &ss, tokens, "r3").unwrap_err().to_string();
    assert!(e.contains("offer has 100 tokens, the prepared request 101"), "{e}");
    let st = cb.status(slot).unwrap();
    assert_eq!(st.state, TransferState::Failed);
    assert!(st.error.as_deref().unwrap_or("").contains("offer has 100 tokens"), "{st:?}");

    // A failed transfer's connection is not kept: the next transfer offers
    // on a new connection (an announcement may still have gone out on the
    // old one while this side had not yet seen it close; it is withdrawn
    // and counts on neither side), after which announcements have
    // somewhere to go again.
    canary();
    let (slot, told) = prepare("r4", tokens);
    assert!(told.is_some());
    moved(slot, "r4");

    // Announced, then cancelled before the submit: the claim is refused,
    // no byte lands, and the source names the refusal.
    canary();
    let before = read_back(&dst);
    let (slot, told) = prepare("r5", tokens);
    assert_eq!(told, Some(Ok(())));
    cb.cancel(slot).unwrap();
    let failed = match submit(&ca, &ss, tokens, "r5") {
        Err(e) => e.to_string(),
        Ok(s) => {
            assert!(ca.wait(s.slot, FlagName::DecoderUsable, WAIT).is_err());
            ca.status(s.slot).unwrap().error.unwrap_or_default()
        }
    };
    assert!(failed.contains("not announced to `a` now") || failed.contains("not prepared"), "{failed}");
    assert!(read_back(&dst) == before, "a cancelled receive was written");

    // And the next transfer is exact, however it starts.
    canary();
    let (slot, _) = prepare("r6", tokens);
    moved(slot, "r6");
}

#[test]
fn a_receive_above_the_announce_bound_is_not_announced_and_its_transfer_offers() {
    let tokens = 100;
    let Pair { ca, cb, ss, ds, dst, .. } = &pair("announce-bound", "[transport]\nannounce_max_bytes = 1000\n", tokens);
    // The first transfer opens `a`'s connection here; the second finds it
    // idle, but its 102400 bytes are above the bound: it offers.
    transfer_exact(&ca, &cb, &ss, &ds, &dst, tokens, "r1");
    let p = PrepareReceive { group: "decode".into(), request: "r2".into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: Some("a".into()) };
    let (slot, told) = cb.prepare_announced(p).unwrap();
    let why = told.expect("the prepare named a source").expect_err("announced above the bound");
    assert!(why.contains("above transport.announce_max_bytes 1000"), "{why}");
    let sslot = submit(&ca, &ss, tokens, "r2").unwrap().slot;
    cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
    ca.wait(sslot, FlagName::DecoderUsable, WAIT).unwrap();
    assert!(read_back(&dst) == verify::expected_destination(&model(), &ds, tokens, 0), "destination bytes differ");
    let sa = ca.stats().unwrap();
    assert_eq!((starts(&sa, "a", "offered"), starts(&sa, "a", "claimed")), (2, 0));
}

/// A count of `kvwire_plans_reused_total` in `stats`.
fn reused(stats: &str, node: &str, when: &str) -> u64 {
    counter(stats, "kvwire_plans_reused_total", node, &format!("when=\"{when}\""))
}

/// A request with the layouts, block tables and token counts of an
/// earlier one takes that one's plans on both sides (the source's, and the
/// destination's at the announcement and at the claim); another table is
/// planned for, and every transfer lands exactly.
#[test]
fn a_request_like_an_earlier_one_is_not_planned_again_and_a_new_table_is() {
    let tokens = 100;
    let Pair { ca, cb, ss, ds, dst, .. } = &pair("plans", "", tokens);
    let moved = |ds: &Side, request: &str| {
        canary(dst);
        let p = PrepareReceive { group: "decode".into(), request: request.into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: Some("a".into()) };
        let slot = cb.prepare(p).unwrap();
        let sslot = submit(ca, ss, tokens, request).unwrap().slot;
        cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
        ca.wait(sslot, FlagName::DecoderUsable, WAIT).unwrap();
        assert!(read_back(dst) == verify::expected_destination(&model(), ds, tokens, 0), "destination bytes differ ({request})");
    };
    let counts = || {
        let (sa, sb) = (ca.stats().unwrap(), cb.stats().unwrap());
        (reused(&sa, "a", "sent"), reused(&sb, "b", "announced"), reused(&sb, "b", "received"))
    };
    // r1 offers (no connection to announce on yet) and plans everywhere;
    // r2 and r3 are announced and claimed, and plan nowhere.
    for r in ["r1", "r2", "r3"] {
        moved(ds, r);
    }
    assert_eq!(counts(), (2, 2, 2));
    // The same blocks in another order at the destination: planned anew.
    let mut other = ds.clone();
    other.block_table.reverse();
    moved(&other, "r4");
    assert_eq!(counts(), (2, 2, 2));
    // The first table's plans are still kept.
    moved(ds, "r5");
    assert_eq!(counts(), (3, 3, 3));
}

/// A count of `kvwire_data_connections_total` in `stats`.
fn data_conns(stats: &str, node: &str, how: &str) -> u64 {
    counter(stats, "kvwire_data_connections_total", node, &format!("how=\"{how}\""))
}

/// Transfers to one peer share its data connection: the first opens it,
/// the next take it kept. Over shm too, where each remapped transfer packs
/// from a staging buffer registered under a key of its own, which the
/// destination is told to forget before the next transfer.
#[test]
fn later_transfers_to_a_peer_take_its_kept_data_connection_over_tcp_and_shm() {
    let tokens = 100;
    for kind in ["tcp", "shm"] {
        let extra = format!("[transport]\nkind = \"{kind}\"\n");
        let Pair { ca, cb, ss, ds, dst, .. } = &pair_with(&format!("kept-{kind}"), &extra, &extra, tokens);
        for r in ["r1", "r2", "r3"] {
            transfer_exact(ca, cb, ss, ds, dst, tokens, r);
        }
        let sa = ca.stats().unwrap();
        assert_eq!((data_conns(&sa, "a", "opened"), data_conns(&sa, "a", "reused")), (1, 2), "{kind}");
    }
}

/// A large submit is answered by whichever of the control thread and the
/// transfer thread gets there first: a client that sends its next request
/// behind the submit, without waiting, still reads the answers in order.
#[test]
fn a_client_asking_again_behind_a_large_submit_reads_its_answers_in_order() {
    use kvwire_client::wire;
    use std::os::fd::AsRawFd;
    let dir = TempDir::new("pipelined");
    let b = start(&dir, "b", "a-secret-of-at-least-16-bytes", &[]);
    let a = start(&dir, "a", "a-secret-of-at-least-16-bytes", &[("b", &b.peer)]);
    let cb = Client::connect(&b.socket, "decode").unwrap();
    // 512 KiB: past the size whose submit waits for its manifest.
    let tokens = 512;
    let (ss, ds) = (side(SRC, tokens), side(DST, tokens));
    let dst = register(&cb, "decode", DST, &ds, None, identity());
    let raw = std::os::unix::net::UnixStream::connect(&a.socket).unwrap();
    let mut reader = wire::UnixReader::new();
    let mut answer = |raw: &std::os::unix::net::UnixStream| wire::parse::<Reply>(&reader.recv(raw).unwrap().0).unwrap();
    wire::send_unix(&raw, &Request::Hello { client: "asks-ahead".into() }, &[]).unwrap();
    assert!(matches!(answer(&raw), Reply::Hello { .. }));
    let m = model();
    let src_bytes = verify::fill_source(&m, &ss, tokens);
    let registers = |r: RegisterCache, mem: &HostMem| {
        wire::send_unix(&raw, &Request::RegisterCache(r), &[mem.fd().as_raw_fd()]).unwrap();
        match answer(&raw) {
            Reply::Registered { regions, bytes, complete } => (regions, bytes, complete),
            other => panic!("registration answered {other:?}"),
        }
    };
    let _src = register_by(registers, "prefill", SRC, &ss, Some(&src_bytes), identity());
    for i in 0..6 {
        canary(&dst);
        let request = format!("r{i}");
        let slot = cb
            .prepare(PrepareReceive { group: "decode".into(), request: request.clone(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: None })
            .unwrap();
        let submit = Request::Submit(Submit {
            request: format!("p-{request}"),
            group: "prefill".into(),
            block_table: ss.block_table.clone(),
            tokens,
            peer: "b".into(),
            dst_group: "decode".into(),
            dst_request: request.clone(),
            codec: None,
            stream: false,
        });
        // Both in one message: the stats request is read before the
        // submit's transfer has got anywhere.
        wire::send_unix_both(&raw, &submit, &Request::Stats).unwrap();
        let sslot = match answer(&raw) {
            Reply::Submitted { slot: sslot, peer_slot, bytes, .. } => {
                assert_eq!((peer_slot, bytes), (slot, 1024 * tokens));
                sslot
            }
            other => panic!("transfer {i}: the first answer is the submit's, not {other:?}"),
        };
        match answer(&raw) {
            Reply::Stats { text } => assert!(text.contains("kvwire_payload_bytes_total"), "{text}"),
            other => panic!("transfer {i}: the second answer is the stats', not {other:?}"),
        }
        cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
        wire::send_unix(&raw, &Request::Wait { slot: sslot, flag: FlagName::DecoderUsable, timeout_ms: 20_000 }, &[]).unwrap();
        assert!(matches!(answer(&raw), Reply::Waited { .. }), "transfer {i}: the source's decoder_usable");
        assert!(read_back(&dst) == verify::expected_destination(&m, &ds, tokens, 0), "transfer {i}: destination bytes differ");
    }
}
