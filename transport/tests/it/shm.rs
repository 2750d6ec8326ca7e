//! Shared-memory transport: the conformance suite over Unix sockets and
//! memfd mappings, plus shm-only cases (hostile raw clients, fd passing,
//! handshakes, peers vanishing).

use crate::conformance::{self, complete, source, tag, w, Pair, Window};
use kvwire_core::protocol::{Header, HelloError, Kind, Tag, HEADER_LEN, NONCE_LEN, PROTOCOL_VERSION as V};
use kvwire_transport::auth;
use kvwire_transport::shm::{ShmEndpoint, ShmLimits, TRAILER_LEN};
use kvwire_transport::{Batch, Endpoint, FlagTable, Hop, Hops, Placement, Registry, TransportError, WriteOp};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(5);

fn endpoint_with(node: &str, regions: usize, limits: ShmLimits) -> Arc<ShmEndpoint> {
    let placement = Arc::new(Placement::new(FlagTable::new(16, 64).unwrap(), Arc::new(Hops::default())));
    ShmEndpoint::new(node, None, Arc::new(Registry::new(regions)), placement, limits).unwrap()
}

pub fn endpoint(node: &str) -> Arc<ShmEndpoint> {
    endpoint_with(node, 64, ShmLimits::default())
}

pub fn pair() -> Pair {
    let mut p = Pair::new(endpoint("src"), endpoint("dst"));
    p.conn();
    p
}

/// A connection from `src` to `dst`, once `dst` has the test session open.
fn connect(src: &Arc<ShmEndpoint>, dst: &Arc<ShmEndpoint>) -> Box<dyn kvwire_transport::Connection> {
    conformance::open_session(&**src, &**dst);
    src.connect(&dst.local_addr(), conformance::cred()).unwrap()
}

mod contract {
    crate::conformance_tests!(super::pair);
}

fn hdr(kind: Kind, key: u32, seq: u64, offset: u64, len: u64) -> Header {
    Header { kind, tag: Tag { slot: 0, layer: 0 }, key, seq, offset, len }
}

fn read_frame(s: &mut UnixStream) -> (Header, Vec<u8>) {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).unwrap();
    let h = Header::decode(&b, 0).unwrap();
    let mut p = vec![0u8; h.len as usize];
    s.read_exact(&mut p).unwrap();
    (h, p)
}

fn hello_json(version: u32, transport: &str, node: &str) -> Vec<u8> {
    format!(r#"{{"version":{version},"transport":"{transport}","node":"{node}","regions":[],"verbs":null}}"#).into_bytes()
}

/// A source's hello proving the test session as node `src`, answering the
/// challenge `nd` (the protocol of kvwire_transport::hello, written out).
fn proving_hello(nd: &[u8]) -> Vec<u8> {
    let ns = [5u8; NONCE_LEN];
    let cred = conformance::cred();
    let proof = auth::mac(cred.key(), "kvwire-data-source-v1", &[b"shm", nd, &ns, b"src"]);
    let h = format!(
        r#"{{"version":{V},"transport":"shm","node":"src","regions":[],"verbs":null,"session":{},"nonce":"{}","proof":"{}"}}"#,
        cred.session,
        auth::hex(&ns),
        auth::hex(&proof)
    );
    [hdr(Kind::Hello, 0, 0, 0, h.len() as u64).encode().as_slice(), h.as_bytes()].concat()
}

/// A raw client that completed the handshake with `path` (whose endpoint
/// has the test session open for `src`).
fn raw_client(path: &str) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let (h, nd) = read_frame(&mut s);
    assert_eq!(h.kind, Kind::Challenge);
    s.write_all(&proving_hello(&nd)).unwrap();
    assert_eq!(read_frame(&mut s).0.kind, Kind::Hello);
    s
}

/// A write request as the module docs lay it out, sharing no fd.
fn write_request(t: Tag, dst_key: u32, seq: u64, dst_offset: u64, src_key: u32, share: u32, len: u64) -> Vec<u8> {
    let mut v = Header { kind: Kind::Write, tag: t, key: dst_key, seq, offset: dst_offset, len: TRAILER_LEN }.encode().to_vec();
    v.extend_from_slice(&src_key.to_le_bytes());
    v.extend_from_slice(&share.to_le_bytes());
    v.extend_from_slice(&[0u8; 16]);
    v.extend_from_slice(&0u64.to_le_bytes());
    v.extend_from_slice(&len.to_le_bytes());
    // One run: no stride.
    v.extend_from_slice(&[0u8; 24]);
    v
}

/// Waits until the peer closes `s` (reads and discards what it sends first).
fn closed_by_peer(mut s: UnixStream) -> Vec<u8> {
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
    sink
}

#[test]
fn local_addr_is_the_socket_path_and_transport_is_shm() {
    let ep = endpoint("a");
    assert_eq!(ep.transport(), kvwire_transport::TransportKind::Shm);
    assert_eq!(ep.local_addr(), ep.path().display().to_string());
    assert!(ep.path().exists());
    let path = ep.path().to_path_buf();
    drop(ep);
    assert!(!path.exists(), "socket file removed with the endpoint");
}

#[test]
fn interleaved_layers_count_bytes_not_order() {
    // 4 layers × 4 batches × 8 scattered runs; every batch but each layer's
    // last is posted first, interleaved and all in flight together.
    const RUN: u64 = 512;
    const LAYER: u64 = 4 * 8 * RUN;
    let mut p = pair();
    let dst = Window::new(&*p.dst, 9, 4 * LAYER);
    let (src, data) = source(&*p.src, 4 * LAYER, 17);
    let pl = p.dst.placement().clone();
    // Layers 0 and 1 declared before any byte; 2 midway; 3 after all bytes.
    pl.expect(tag(9, 0), LAYER).unwrap();
    pl.expect(tag(9, 1), LAYER).unwrap();
    // Batch b of layer l carries runs i = b*8..b*8+8, each placed at the
    // mirrored position inside the layer.
    let batch = |l: u64, b: u64| Batch {
        tag: tag(9, l as u16),
        writes: (b * 8..b * 8 + 8).map(|i| w(&src, l * LAYER + i * RUN, &dst.region, l * LAYER + (31 - i) * RUN, RUN)).collect(),
    };
    let mut ids = Vec::new();
    for b in 0..3 {
        for l in [2, 0, 3, 1] {
            ids.push(p.conn().post(batch(l, b)).unwrap());
        }
    }
    let done = complete(p.conn(), ids.len());
    let mut got: Vec<_> = done.iter().map(|c| c.batch).collect();
    got.sort();
    assert_eq!(got, ids, "one completion per batch");
    for c in &done {
        assert_eq!(c.result, Ok(()));
        assert_eq!(c.bytes, 8 * RUN);
    }
    for l in 0..4 {
        assert_eq!(pl.placed_bytes(tag(9, l)), 3 * 8 * RUN, "layer {l}: placed bytes counted by the time the source was released");
        assert!(pl.flags().ready(tag(9, l)).is_none(), "layer {l} flagged before its last batch");
    }
    pl.expect(tag(9, 2), LAYER).unwrap();
    assert!(pl.flags().ready(tag(9, 2)).is_none());
    for l in [3, 1, 2, 0] {
        p.conn().post(batch(l, 3)).unwrap();
    }
    assert!(complete(p.conn(), 4).iter().all(|c| c.result.is_ok()));
    for l in 0..3 {
        pl.wait(tag(9, l), WAIT).unwrap();
    }
    assert!(pl.flags().ready(tag(9, 3)).is_none(), "layer 3 flagged before it was declared");
    pl.expect(tag(9, 3), LAYER).unwrap();
    pl.wait(tag(9, 3), WAIT).unwrap();
    let mut want = vec![0u8; (4 * LAYER) as usize];
    for l in 0..4u64 {
        for i in 0..32u64 {
            let (s, d) = ((l * LAYER + i * RUN) as usize, (l * LAYER + (31 - i) * RUN) as usize);
            want[d..d + RUN as usize].copy_from_slice(&data[s..s + RUN as usize]);
        }
    }
    assert_eq!(dst.bytes(), want);
    dst.assert_guards();
    // The initiator timed its hops into the source endpoint's histograms.
    let hops = p.src.placement().hops();
    assert_eq!(hops.summary(Hop::Post).count, 16);
    assert_eq!(hops.summary(Hop::Wire).count, 16);
    assert_eq!(hops.summary(Hop::Wire).bytes, 4 * LAYER);
}

#[test]
fn batch_from_more_source_regions_than_one_message_can_carry() {
    // 260 source regions: their memfds go out in two SCM_RIGHTS messages.
    const N: u64 = 260;
    let src_ep = endpoint_with("src", 512, ShmLimits::default());
    let dst_ep = endpoint("dst");
    let mut conn = connect(&src_ep, &dst_ep);
    let dst = Window::new(&*dst_ep, 1, N * 64);
    let sources: Vec<_> = (0..N).map(|i| source(&*src_ep, 64, i as u8)).collect();
    let writes = sources.iter().enumerate().map(|(i, (r, _))| w(r, 0, &dst.region, i as u64 * 64, 64)).collect();
    dst_ep.placement().expect(tag(1, 1), N * 64).unwrap();
    conn.post(Batch { tag: tag(1, 1), writes }).unwrap();
    assert_eq!(complete(&mut *conn, 1)[0].result, Ok(()));
    dst_ep.placement().wait(tag(1, 1), WAIT).unwrap();
    let want: Vec<u8> = sources.iter().flat_map(|(_, d)| d.iter().copied()).collect();
    assert_eq!(dst.bytes(), want);
    dst.assert_guards();
    // Reusing the already-shared sources sends no fd and still works.
    let dst2 = Window::new(&*dst_ep, 1, 64);
    dst_ep.placement().expect(tag(1, 2), 64).unwrap();
    conn.post(Batch { tag: tag(1, 2), writes: vec![w(&sources[200].0, 0, &dst2.region, 0, 64)] }).unwrap();
    assert_eq!(complete(&mut *conn, 1)[0].result, Ok(()));
    assert_eq!(dst2.bytes(), sources[200].1);
    dst2.assert_guards();
}

#[test]
fn batches_posted_together_share_their_sources_across_messages_once_each() {
    // Three batches over 300 source regions, two of them shared by two
    // batches: every memfd goes once, over two SCM_RIGHTS messages.
    const N: u64 = 300;
    let src_ep = endpoint_with("src", 512, ShmLimits::default());
    let dst_ep = endpoint("dst");
    let mut conn = connect(&src_ep, &dst_ep);
    let dst = Window::new(&*dst_ep, 1, (N + 2) * 64);
    let sources: Vec<_> = (0..N).map(|i| source(&*src_ep, 64, i as u8)).collect();
    let write = |i: u64, at: u64| w(&sources[i as usize].0, 0, &dst.region, at * 64, 64);
    let batches: Vec<Batch> = (0..3u16)
        .map(|b| {
            let mine = (u64::from(b) * 100..u64::from(b) * 100 + 100).map(|i| write(i, i));
            // The first two sources again, from the later batches.
            let again = (b > 0).then(|| write(u64::from(b) - 1, N + u64::from(b) - 1));
            Batch { tag: tag(1, b), writes: mine.chain(again).collect() }
        })
        .collect();
    for b in &batches {
        dst_ep.placement().expect(b.tag, b.bytes()).unwrap();
    }
    let ids = conn.post_all(batches).unwrap();
    let done = complete(&mut *conn, 3);
    assert!(ids.iter().all(|id| done.iter().any(|c| c.batch == *id && c.result == Ok(()))), "{done:?}");
    let mut want: Vec<u8> = sources.iter().flat_map(|(_, d)| d.iter().copied()).collect();
    want.extend(sources[0].1.iter().chain(&sources[1].1));
    assert_eq!(dst.bytes(), want);
    dst.assert_guards();
}

#[test]
fn revoke_after_use_refuses_later_writes_exactly() {
    let mut p = pair();
    let dst = Window::new(&*p.dst, 2, 4096);
    let (src, data) = source(&*p.src, 8192, 4);
    p.dst.placement().expect(tag(2, 0), 4096).unwrap();
    p.conn().post(Batch { tag: tag(2, 0), writes: vec![w(&src, 0, &dst.region, 0, 4096)] }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    assert_eq!(dst.bytes(), &data[..4096]);
    assert!(p.dst.revoke(dst.region.key));
    // The same source (already shared) into the revoked region: refused.
    p.conn().post(Batch { tag: tag(2, 1), writes: vec![w(&src, 4096, &dst.region, 0, 4096)] }).unwrap();
    let c = complete(p.conn(), 1);
    match &c[0].result {
        Err(TransportError::Refused(why)) => assert!(why.contains("revoked"), "{why}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(dst.bytes(), &data[..4096], "revoked region unchanged");
    dst.assert_guards();
    assert_eq!(p.dst.placement().placed_bytes(tag(2, 1)), 0);
    // A batch mixing a good and a refused write fails as a whole, once
    // both were answered; the connection keeps serving.
    let other = Window::new(&*p.dst, 2, 4096);
    let mixed = vec![w(&src, 0, &other.region, 0, 1024), w(&src, 0, &dst.region, 0, 16)];
    p.conn().post(Batch { tag: tag(2, 2), writes: mixed }).unwrap();
    let c = complete(p.conn(), 1);
    assert!(matches!(c[0].result, Err(TransportError::Refused(_))), "{:?}", c[0].result);
    assert_eq!(p.conn().pending(), 0);
    p.dst.placement().expect(tag(2, 3), 3072).unwrap();
    p.conn().post(Batch { tag: tag(2, 3), writes: vec![w(&src, 1024, &other.region, 1024, 3072)] }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    p.dst.placement().wait(tag(2, 3), WAIT).unwrap();
    assert_eq!(other.bytes(), &data[..4096]);
    other.assert_guards();
}

#[test]
fn unknown_slot_is_refused_before_any_byte_lands() {
    let mut p = pair();
    let dst = Window::new(&*p.dst, 999, 256);
    let (src, _) = source(&*p.src, 256, 8);
    let before = dst.bytes();
    p.conn().post(Batch { tag: tag(999, 0), writes: vec![w(&src, 0, &dst.region, 0, 256)] }).unwrap();
    let c = complete(p.conn(), 1);
    match &c[0].result {
        Err(TransportError::Refused(why)) => assert!(why.contains("flag table"), "{why}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(dst.bytes(), before);
    dst.assert_guards();
}

#[test]
fn hostile_raw_clients_close_only_their_connection() {
    let mut p = pair();
    let addr = p.dst.local_addr();
    let pl = p.dst.placement().clone();
    let dst = Window::new(&*p.dst, 3, 4096);
    pl.expect(tag(3, 0), 4096).unwrap();

    // Garbage instead of a hello.
    let mut raw = UnixStream::connect(&addr).unwrap();
    raw.write_all(&[0xFFu8; 100]).unwrap();
    closed_by_peer(raw);
    // A hello header claiming an enormous payload.
    let mut raw = UnixStream::connect(&addr).unwrap();
    raw.write_all(&hdr(Kind::Hello, 0, 0, 0, u64::MAX).encode()).unwrap();
    closed_by_peer(raw);
    // Half a header, then gone.
    let mut raw = UnixStream::connect(&addr).unwrap();
    raw.write_all(&hdr(Kind::Hello, 0, 0, 0, 10).encode()[..HEADER_LEN / 2]).unwrap();
    drop(raw);
    // After a good handshake: a truncated write request.
    let mut raw = raw_client(&addr);
    raw.write_all(&write_request(tag(3, 0), dst.region.key, 0, 0, 1, 0, 4096)[..HEADER_LEN + 10]).unwrap();
    drop(raw);
    // A write claiming to share an fd that never came.
    let mut raw = raw_client(&addr);
    raw.write_all(&write_request(tag(3, 0), dst.region.key, 0, 0, 1, 1, 4096)).unwrap();
    closed_by_peer(raw);
    // An undefined share value; a data-carrying write (TCP style); an ack.
    for bad in [
        write_request(tag(3, 0), dst.region.key, 0, 0, 1, 7, 4096),
        [Header { kind: Kind::Write, tag: tag(3, 0), key: dst.region.key, seq: 0, offset: 0, len: 16 }.encode().as_slice(), &[0u8; 16]].concat(),
        hdr(Kind::Ack, 0, 0, 0, 0).encode().to_vec(),
    ] {
        let mut raw = raw_client(&addr);
        raw.write_all(&bad).unwrap();
        closed_by_peer(raw);
    }
    // A forget of a source never shared; a forget carrying write fields.
    for bad in [write_request(tag(0, 0), 0, 0, 0, 0x99, 2, 0), write_request(tag(3, 0), dst.region.key, 0, 0, 0x99, 2, 0), write_request(tag(0, 0), 0, 0, 0, 0x99, 2, 16)] {
        let mut raw = raw_client(&addr);
        raw.write_all(&bad).unwrap();
        assert!(closed_by_peer(raw).is_empty(), "a forget is never answered");
    }
    // A write from a source never shared: refused by name, connection kept.
    let mut raw = raw_client(&addr);
    raw.write_all(&write_request(tag(3, 0), dst.region.key, 5, 0, 0x77, 0, 4096)).unwrap();
    let (h, why) = read_frame(&mut raw);
    assert_eq!((h.kind, h.seq), (Kind::Nack, 5));
    assert!(String::from_utf8_lossy(&why).contains("never shared"), "{}", String::from_utf8_lossy(&why));
    raw.write_all(&write_request(tag(3, 0), 0xBAD, 6, 0, 0x77, 0, 16)).unwrap();
    let (h, why) = read_frame(&mut raw);
    assert_eq!((h.kind, h.seq), (Kind::Nack, 6));
    assert!(String::from_utf8_lossy(&why).contains("unknown or revoked"));
    drop(raw);

    assert_eq!(pl.placed_bytes(tag(3, 0)), 0, "no hostile byte counted");
    assert!(pl.flags().ready(tag(3, 0)).is_none());
    assert!(dst.bytes().iter().all(|&b| b == conformance::CANARY), "no hostile byte landed");
    dst.assert_guards();
    // The endpoint still serves a proper peer, on a new and the old connection.
    let (src, data) = source(&*p.src, 4096, 6);
    p.conn().post(Batch { tag: tag(3, 0), writes: vec![w(&src, 0, &dst.region, 0, 4096)] }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    pl.wait(tag(3, 0), WAIT).unwrap();
    assert_eq!(dst.bytes(), data);
    conformance::one_segment(&mut Pair { conn: Some(p.src.connect(&addr, conformance::cred()).unwrap()), src: p.src.clone(), dst: p.dst.clone() });
}

#[test]
fn version_mismatch_is_refused_by_name_at_the_destination() {
    let dst = endpoint("dst");
    let mut raw = UnixStream::connect(dst.local_addr()).unwrap();
    raw.set_read_timeout(Some(WAIT)).unwrap();
    let hello = hello_json(99, "shm", "old-peer");
    raw.write_all(&hdr(Kind::Hello, 0, 0, 0, hello.len() as u64).encode()).unwrap();
    raw.write_all(&hello).unwrap();
    let (h, _) = read_frame(&mut raw);
    assert_eq!(h.kind, Kind::Challenge, "the destination challenges first");
    let (h, why) = read_frame(&mut raw);
    assert_eq!(h.kind, Kind::Nack);
    let why = String::from_utf8(why).unwrap();
    assert!(why.contains("version 99") && why.contains(&format!("speaks {V}")), "{why}");
    closed_by_peer(raw);
    // Still serving.
    conformance::one_segment(&mut pair_to(&dst));
}

fn pair_to(dst: &Arc<ShmEndpoint>) -> Pair {
    let src = endpoint("src");
    let conn = connect(&src, dst);
    Pair { src, dst: dst.clone(), conn: Some(conn) }
}

/// What a fake destination answers the initiator's hello with.
enum Answer {
    /// A hello (version, transport, node) proving the test session.
    Hello(u32, &'static str, &'static str),
    /// A refusal with this reason.
    Nack(&'static [u8]),
}

/// A fake destination on a fresh socket: challenges, reads the
/// initiator's hello, answers, then runs `then` on the stream.
fn fake_destination(answer: Answer, then: impl FnOnce(UnixStream) + Send + 'static) -> (String, std::thread::JoinHandle<()>, tempdir::Dir) {
    let dir = tempdir::Dir::new();
    let path = dir.0.join("fake.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let nd = [3u8; NONCE_LEN];
        s.write_all(&hdr(Kind::Challenge, 0, 0, 0, NONCE_LEN as u64).encode()).unwrap();
        s.write_all(&nd).unwrap();
        let (h, theirs) = read_frame(&mut s);
        assert_eq!(h.kind, Kind::Hello);
        let theirs: serde_json::Value = serde_json::from_slice(&theirs).unwrap();
        let ns = auth::unhex(theirs["nonce"].as_str().unwrap(), NONCE_LEN).unwrap();
        match answer {
            Answer::Hello(version, transport, node) => {
                let proof = auth::mac(conformance::cred().key(), "kvwire-data-destination-v1", &[transport.as_bytes(), &ns, &nd, node.as_bytes()]);
                let hello = format!(
                    r#"{{"version":{version},"transport":"{transport}","node":"{node}","regions":[],"verbs":null,"proof":"{}"}}"#,
                    auth::hex(&proof)
                );
                s.write_all(&hdr(Kind::Hello, 0, 0, 0, hello.len() as u64).encode()).unwrap();
                s.write_all(hello.as_bytes()).unwrap();
            }
            Answer::Nack(why) => {
                s.write_all(&hdr(Kind::Nack, 0, 0, 0, why.len() as u64).encode()).unwrap();
                s.write_all(why).unwrap();
            }
        }
        then(s);
    });
    (path.display().to_string(), t, dir)
}

mod tempdir {
    /// A private directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Dir {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let d = std::env::temp_dir().join(format!("kvwire-shm-test-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir(&d).unwrap();
            Dir(d)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn version_mismatch_is_refused_by_name_at_the_initiator() {
    let src = endpoint("src");
    let (addr, fake, _dir) = fake_destination(Answer::Hello(V + 1, "shm", "future-peer"), |s| drop(closed_by_peer(s)));
    let e = src.connect(&addr, conformance::cred()).err().expect("connect must fail");
    assert_eq!(e, TransportError::Hello(HelloError::Version { node: "future-peer".into(), theirs: V + 1, ours: V }));
    let text = e.to_string();
    assert!(text.contains(&format!("version {}", V + 1)) && text.contains(&format!("speaks {V}")), "{text}");
    fake.join().unwrap();

    let (addr, fake, _dir) = fake_destination(Answer::Hello(V, "tcp", "tcp-peer"), |s| drop(closed_by_peer(s)));
    let e = src.connect(&addr, conformance::cred()).err().expect("connect must fail");
    assert!(matches!(e, TransportError::Hello(HelloError::Transport { .. })), "{e}");
    assert!(e.to_string().contains("`tcp`") && e.to_string().contains("`shm`"), "{e}");
    fake.join().unwrap();

    // A destination that accepts our hello's format but refuses it anyway.
    let (addr, fake, _dir) = fake_destination(Answer::Nack(b"no room for another peer"), move |s| drop(closed_by_peer(s)));
    let e = src.connect(&addr, conformance::cred()).err().expect("connect must fail");
    assert!(e.to_string().contains("no room for another peer"), "{e}");
    fake.join().unwrap();
}

#[test]
fn peer_closing_mid_batch_fails_outstanding_batches() {
    let src = endpoint("src");
    let (go, wait) = std::sync::mpsc::channel::<()>();
    // Reads the first write request (and its fd), then vanishes on cue.
    let (addr, fake, _dir) = fake_destination(Answer::Hello(V, "shm", "fake"), move |mut s| {
        let mut first = vec![0u8; HEADER_LEN + TRAILER_LEN as usize];
        s.read_exact(&mut first).unwrap();
        wait.recv_timeout(WAIT).unwrap();
    });
    let mut conn = src.connect(&addr, conformance::cred()).unwrap();
    assert_eq!(conn.remote().node, "fake");
    let (region, _) = source(&*src, 1 << 16, 1);
    for layer in 0..3 {
        let write = WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 1 << 16, stride: None };
        conn.post(Batch { tag: Tag { slot: 1, layer }, writes: vec![write] }).unwrap();
    }
    assert_eq!(conn.pending(), 3);
    go.send(()).unwrap();
    fake.join().unwrap();
    let c = complete(&mut *conn, 3);
    for c in &c {
        assert_eq!(c.result, Err(TransportError::PeerClosed { pending: 3 }));
    }
    assert_eq!(conn.pending(), 0);
    let write = WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 16, stride: None };
    assert!(conn.post(Batch { tag: Tag { slot: 1, layer: 4 }, writes: vec![write] }).is_err(), "a closed connection takes no more batches");
}

/// A destination answers each request before it reads the next: the
/// initiator must read answers while its requests wait for room, or both
/// ends stall once the sockets are full. 100,000 requests in one batch.
#[test]
fn answers_are_read_while_a_large_batch_is_still_being_requested() {
    const WRITES: usize = 100_000;
    let src = endpoint("src");
    let (addr, fake, _dir) = fake_destination(Answer::Hello(V, "shm", "fake"), move |s| {
        let mut r = std::io::BufReader::new(s.try_clone().unwrap());
        let mut w = std::io::BufWriter::with_capacity(4096, s);
        for _ in 0..WRITES {
            let mut req = vec![0u8; HEADER_LEN + TRAILER_LEN as usize];
            r.read_exact(&mut req).unwrap();
            let seq = Header::decode(&req, TRAILER_LEN).unwrap().seq;
            w.write_all(&hdr(Kind::Ack, 0, seq, 1, 0).encode()).unwrap();
        }
        w.flush().unwrap();
    });
    let conn = src.connect(&addr, conformance::cred()).unwrap();
    let (region, _) = source(&*src, 64, 1);
    let write = WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 1, stride: None };
    let (result, pending) = conformance::within(conn, Duration::from_secs(60), "the batch stalled: its answers were not read while it was requested", move |conn| {
        conn.post(Batch { tag: Tag { slot: 1, layer: 0 }, writes: vec![write; WRITES] }).unwrap();
        let c = complete(conn, 1);
        (c[0].result.clone(), conn.pending())
    });
    assert_eq!(result, Ok(()));
    assert_eq!(pending, 0);
    fake.join().unwrap();
}

#[test]
fn an_answer_for_no_outstanding_write_closes_the_connection() {
    let src = endpoint("src");
    // Acks a write that was never requested, as a peer out of sync would.
    let (addr, fake, _dir) = fake_destination(Answer::Hello(V, "shm", "fake"), move |mut s| {
        let mut first = vec![0u8; HEADER_LEN + TRAILER_LEN as usize];
        s.read_exact(&mut first).unwrap();
        let seq = Header::decode(&first, TRAILER_LEN).unwrap().seq;
        s.write_all(&hdr(Kind::Ack, 0, seq + 1000, 0, 0).encode()).unwrap();
        drop(closed_by_peer(s));
    });
    let mut conn = src.connect(&addr, conformance::cred()).unwrap();
    let (region, _) = source(&*src, 64, 1);
    let write = WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 64, stride: None };
    conn.post(Batch { tag: Tag { slot: 1, layer: 0 }, writes: vec![write] }).unwrap();
    let c = complete(&mut *conn, 1);
    assert_eq!(c[0].result, Err(TransportError::PeerClosed { pending: 1 }));
    assert!(conn.post(Batch { tag: Tag { slot: 1, layer: 1 }, writes: vec![write] }).is_err(), "closed");
    fake.join().unwrap();
}

#[test]
fn initiator_vanishing_mid_layer_publishes_no_flag() {
    let dst_ep = endpoint("dst");
    let src_ep = endpoint("src");
    // The session first: the window is granted to its node.
    let mut conn = connect(&src_ep, &dst_ep);
    let dst = Window::new(&*dst_ep, 4, 8192);
    let (src, data) = source(&*src_ep, 8192, 12);
    let pl = dst_ep.placement().clone();
    pl.expect(tag(4, 0), 8192).unwrap();
    conn.post(Batch { tag: tag(4, 0), writes: vec![w(&src, 0, &dst.region, 0, 4096)] }).unwrap();
    assert_eq!(complete(&mut *conn, 1)[0].result, Ok(()));
    drop(conn);
    // A raw client that shares nothing and dies mid-request adds nothing.
    let mut raw = raw_client(&dst_ep.local_addr());
    raw.write_all(&write_request(tag(4, 0), dst.region.key, 0, 4096, 1, 0, 4096)[..HEADER_LEN + 20]).unwrap();
    drop(raw);
    assert_eq!(pl.placed_bytes(tag(4, 0)), 4096);
    assert!(pl.flags().ready(tag(4, 0)).is_none(), "half a layer is not a layer");
    // A new connection finishes the layer.
    let mut conn = connect(&src_ep, &dst_ep);
    conn.post(Batch { tag: tag(4, 0), writes: vec![w(&src, 4096, &dst.region, 4096, 4096)] }).unwrap();
    assert_eq!(complete(&mut *conn, 1)[0].result, Ok(()));
    pl.wait(tag(4, 0), WAIT).unwrap();
    assert_eq!(dst.bytes(), data);
    dst.assert_guards();
}

#[test]
fn too_many_shared_sources_close_the_connection() {
    let src_ep = endpoint("src");
    let limits = ShmLimits { max_sources: 2, ..ShmLimits::default() };
    let dst_ep = endpoint_with("dst", 64, limits);
    let mut conn = connect(&src_ep, &dst_ep);
    let dst = Window::new(&*dst_ep, 5, 3 * 64);
    let sources: Vec<_> = (0..3).map(|i| source(&*src_ep, 64, i)).collect();
    let writes = sources.iter().enumerate().map(|(i, (r, _))| w(r, 0, &dst.region, i as u64 * 64, 64)).collect();
    conn.post(Batch { tag: tag(5, 0), writes }).unwrap();
    let c = complete(&mut *conn, 1);
    assert_eq!(c[0].result, Err(TransportError::PeerClosed { pending: 1 }));
    dst.assert_guards();
    // Other connections are unaffected.
    conformance::one_segment(&mut pair_to(&dst_ep));
}

#[test]
fn dropping_the_destination_fails_the_initiators_batches() {
    let src_ep = endpoint("src");
    let dst_ep = endpoint("dst");
    let mut conn = connect(&src_ep, &dst_ep);
    drop(dst_ep);
    let (src, _) = source(&*src_ep, 64, 1);
    let op = WriteOp { src_key: src.key, src_offset: 0, dst_key: 1, dst_offset: 0, len: 64, stride: None };
    match conn.post(Batch { tag: tag(1, 0), writes: vec![op] }) {
        Ok(_) => {
            let c = complete(&mut *conn, 1);
            assert!(matches!(c[0].result, Err(TransportError::PeerClosed { .. })), "{:?}", c[0].result);
        }
        Err(e) => assert!(matches!(e, TransportError::PeerClosed { .. } | TransportError::Io { .. }), "{e}"),
    }
}

#[test]
fn a_kept_shm_connection_has_the_peer_unmap_what_it_shared_and_released() {
    // The peer keeps each shared memfd mapped by key until told to forget
    // it: a connection is reused once every key it shared and released
    // since (a transfer's staging buffer) is forgotten there.
    let mut p = pair();
    assert!(p.conn().reusable());
    conformance::one_segment(&mut p);
    assert!(p.conn().reusable(), "every write answered, its source still registered");
    // A second transfer on the kept connection lands.
    conformance::scatter(&mut p);
    assert!(p.conn().reusable());
    let send = |p: &mut Pair, src: &kvwire_transport::Region, slot: u16| {
        let dst = Window::new(&*p.dst, slot, 4096);
        p.dst.placement().expect(tag(slot, 0), 4096).unwrap();
        p.conn().post(Batch { tag: tag(slot, 0), writes: vec![w(src, 0, &dst.region, 0, 4096)] }).unwrap();
        assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    };
    let (src, _) = source(&*p.src, 4096, 1);
    send(&mut p, &src, 3);
    assert!(p.conn().reusable());
    // Released here: forgotten there, and the connection serves on.
    assert!(p.src.revoke(src.key));
    assert!(p.conn().reusable());
    let (src, _) = source(&*p.src, 4096, 4);
    send(&mut p, &src, 6);

    // A key that names another region than the one shared under it: the
    // peer's old mapping is gone, so the write reads the new region.
    let (src, _) = source(&*p.src, 4096, 2);
    send(&mut p, &src, 4);
    assert!(p.src.revoke(src.key));
    let (other, data) = source(&*p.src, 4096, 3);
    p.src.registry().revoke(other.key);
    p.src.registry().register_with_key(other.mem.clone(), 0, 4096, src.key, None).unwrap();
    let again = p.src.registry().get(src.key).unwrap();
    assert!(p.conn().reusable());
    let dst = Window::new(&*p.dst, 5, 4096);
    p.dst.placement().expect(tag(5, 0), 4096).unwrap();
    p.conn().post(Batch { tag: tag(5, 0), writes: vec![w(&again, 0, &dst.region, 0, 4096)] }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    assert_eq!(dst.bytes(), data, "the bytes of the region now under the key, not of the one shared before");
    dst.assert_guards();
}

#[test]
fn a_kept_shm_connection_moves_from_new_stages_past_the_peers_source_limit() {
    // One staging buffer per transfer, each released after it: the peer
    // unmaps each one, so a peer that maps at most 2 sources serves five
    // transfers on one connection.
    let src_ep = endpoint("src");
    let dst_ep = endpoint_with("dst", 64, ShmLimits { max_sources: 2, ..ShmLimits::default() });
    let mut p = Pair { conn: Some(connect(&src_ep, &dst_ep)), src: src_ep.clone(), dst: dst_ep.clone() };
    for i in 0..5u16 {
        let (stage, data) = source(&*src_ep, 256, i as u8 + 10);
        let dst = Window::new(&*dst_ep, 6 + i, 256);
        dst_ep.placement().expect(tag(6 + i, 0), 256).unwrap();
        p.conn().post(Batch { tag: tag(6 + i, 0), writes: vec![w(&stage, 0, &dst.region, 0, 256)] }).unwrap();
        assert_eq!(complete(p.conn(), 1)[0].result, Ok(()), "transfer {i}");
        assert_eq!(dst.bytes(), data);
        assert!(src_ep.revoke(stage.key));
        assert!(p.conn().reusable(), "transfer {i}: its stage forgotten");
    }
}

/// Strided writes: one request each (see conformance::strided_writes).
#[test]
fn strided_writes_land_run_by_run_and_count_once() {
    conformance::strided_writes(&mut pair());
}

/// An endpoint removes what killed processes left where it binds: in the
/// temp directory their socket directories (named as an endpoint names
/// them, of this uid, holding only their socket), in a configured one their
/// sockets; nothing else.
#[test]
fn sockets_and_socket_directories_of_dead_processes_are_swept() {
    let tmp = std::env::temp_dir();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let make = |name: &str, files: &[&str]| {
        let d = tmp.join(name);
        std::fs::create_dir(&d).unwrap();
        for f in files {
            std::fs::write(d.join(f), b"").unwrap();
        }
        d
    };
    let stale = make(&format!("kvwire-shm-{dead}-7-0000abcd"), &[&format!("kvwire-shm-{dead}-7.sock")]);
    let crowded = make(&format!("kvwire-shm-{dead}-8-0000abcd"), &[&format!("kvwire-shm-{dead}-8.sock"), "other"]);
    let live = make(&format!("kvwire-shm-{}-9-0000abcd", std::process::id()), &[&format!("kvwire-shm-{}-9.sock", std::process::id())]);
    let unlike = make(&format!("kvwire-shm-{dead}-7-notahexx"), &[]);
    let ep = endpoint_with("sweeper", 4, ShmLimits::default());
    assert!(!stale.exists(), "the dead process's directory is still there");
    assert!(crowded.join("other").exists(), "a directory holding more than its socket was emptied");
    assert!(live.exists(), "a live process's directory was removed");
    assert!(unlike.exists(), "a directory not named as an endpoint names it was removed");
    assert!(ep.path().exists());
    for d in [&crowded, &live, &unlike] {
        let _ = std::fs::remove_dir_all(d);
    }
    // A configured directory: the dead process's socket goes; a live
    // one's, one still served (a process of another pid namespace), and a
    // file named like a socket that is none, stay.
    let dir = kvwire_testkit::TempDir::new("shm-sweep");
    let sock = |pid: u32, n: u32| dir.path().join(format!("kvwire-shm-{pid}-{n}.sock"));
    drop(UnixListener::bind(sock(dead, 3)).unwrap());
    drop(UnixListener::bind(sock(std::process::id(), 4)).unwrap());
    std::fs::write(sock(dead, 5), b"").unwrap();
    let served = UnixListener::bind(sock(dead, 6)).unwrap();
    let placement = Arc::new(Placement::new(FlagTable::new(4, 4).unwrap(), Arc::new(Hops::default())));
    let ep = ShmEndpoint::new("sweeper", Some(dir.path()), Arc::new(Registry::new(4)), placement, ShmLimits::default()).unwrap();
    assert!(!sock(dead, 3).exists(), "the dead process's socket is still there");
    assert!(sock(std::process::id(), 4).exists() && sock(dead, 5).exists() && sock(dead, 6).exists());
    drop((ep, served));
}
