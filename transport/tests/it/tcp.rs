//! TCP emulation: the conformance suite on loopback, plus TCP-only cases.

use crate::conformance::{self, Pair};
use kvwire_core::protocol::{Header, Kind, Tag, HEADER_LEN, NONCE_LEN, PROTOCOL_VERSION as V};
use kvwire_transport::auth::{self, ConnectionCaps, Credential};
use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
use kvwire_transport::{Batch, Endpoint, FlagTable, Hops, Placement, Registry, TransportError, WriteOp};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn frame(kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut v = Header { kind, tag: Tag { slot: 0, layer: 0 }, key: 0, seq: 0, offset: 0, len: payload.len() as u64 }.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

fn read_frame(s: &mut TcpStream) -> (Header, Vec<u8>) {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).unwrap();
    let h = Header::decode(&b, u64::MAX).unwrap();
    let mut payload = vec![0u8; h.len as usize];
    s.read_exact(&mut payload).unwrap();
    (h, payload)
}

/// A destination's side of the handshake, written out from the protocol
/// (kvwire_transport::hello's module docs): challenge, check nothing,
/// prove `cred` back as node `fake`.
fn fake_destination_handshake(s: &mut TcpStream, cred: &Credential) {
    let nd = [7u8; NONCE_LEN];
    s.write_all(&frame(Kind::Challenge, &nd)).unwrap();
    let (_, hello) = read_frame(s);
    let hello: serde_json::Value = serde_json::from_slice(&hello).unwrap();
    let ns = auth::unhex(hello["nonce"].as_str().unwrap(), NONCE_LEN).unwrap();
    let proof = auth::mac(cred.key(), "kvwire-data-destination-v1", &[b"tcp", &ns, &nd, b"fake"]);
    let ours = format!(r#"{{"version":{V},"transport":"tcp","node":"fake","regions":[],"verbs":null,"proof":"{}"}}"#, auth::hex(&proof));
    s.write_all(&frame(Kind::Hello, ours.as_bytes())).unwrap();
}

/// A source's hello as an outsider would send it: `node`, claiming
/// `session`, proving it with `key`.
/// A fake destination on loopback: it takes one connection, runs its side
/// of the handshake, then hands the stream to `serve`. Its address, and
/// the thread to join.
fn fake_destination(serve: impl FnOnce(TcpStream) + Send + 'static) -> (String, std::thread::JoinHandle<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        fake_destination_handshake(&mut s, conformance::cred());
        serve(s);
    });
    (addr, t)
}

fn hello_from(nd: &[u8], node: &str, session: u64, key: &[u8]) -> Vec<u8> {
    let ns = [9u8; NONCE_LEN];
    let proof = auth::mac(key, "kvwire-data-source-v1", &[b"tcp", nd, &ns, node.as_bytes()]);
    let h = format!(
        r#"{{"version":{V},"transport":"tcp","node":"{node}","regions":[],"verbs":null,"session":{session},"nonce":"{}","proof":"{}"}}"#,
        auth::hex(&ns),
        auth::hex(&proof)
    );
    frame(Kind::Hello, h.as_bytes())
}

pub fn endpoint(node: &str) -> Arc<TcpEndpoint> {
    endpoint_at(node, "127.0.0.1:0")
}

pub fn endpoint_at(node: &str, addr: &str) -> Arc<TcpEndpoint> {
    let placement = Arc::new(Placement::new(FlagTable::new(16, 64).unwrap(), Arc::new(Hops::default())));
    TcpEndpoint::bind(node, addr.parse().unwrap(), Arc::new(Registry::new(64)), placement, TcpLimits::default()).unwrap()
}

pub fn pair() -> Pair {
    Pair::new(endpoint("src"), endpoint("dst"))
}

mod contract {
    crate::conformance_tests!(super::pair);
}

#[test]
fn hostile_bytes_close_only_that_connection() {
    let mut p = pair();
    // Garbage instead of a hello, then a header with a huge length.
    let mut raw = TcpStream::connect(p.dst.local_addr()).unwrap();
    raw.write_all(&[0xFFu8; 100]).unwrap();
    let mut sink = Vec::new();
    let _ = raw.read_to_end(&mut sink);
    let mut raw = TcpStream::connect(p.dst.local_addr()).unwrap();
    let h = Header { kind: Kind::Hello, tag: Tag { slot: 0, layer: 0 }, key: 0, seq: 0, offset: 0, len: u64::MAX };
    raw.write_all(&h.encode()).unwrap();
    let _ = raw.read_to_end(&mut sink);
    // A truncated frame: half a header, then close.
    let mut raw = TcpStream::connect(p.dst.local_addr()).unwrap();
    raw.write_all(&h.encode()[..HEADER_LEN / 2]).unwrap();
    drop(raw);
    // The endpoint still serves a proper peer.
    conformance::one_segment(&mut p);
}

#[test]
fn version_mismatch_is_refused_by_name() {
    let dst = endpoint("dst");
    let mut raw = TcpStream::connect(dst.local_addr()).unwrap();
    assert_eq!(read_frame(&mut raw).0.kind, Kind::Challenge);
    let hello = br#"{"version":99,"transport":"tcp","node":"old-peer","regions":[],"verbs":null}"#;
    let h = Header { kind: Kind::Hello, tag: Tag { slot: 0, layer: 0 }, key: 0, seq: 0, offset: 0, len: hello.len() as u64 };
    raw.write_all(&h.encode()).unwrap();
    raw.write_all(hello).unwrap();
    let mut b = [0u8; HEADER_LEN];
    raw.read_exact(&mut b).unwrap();
    let reply = Header::decode(&b, 0).unwrap();
    assert_eq!(reply.kind, Kind::Nack);
    let mut why = vec![0u8; reply.len as usize];
    raw.read_exact(&mut why).unwrap();
    let why = String::from_utf8(why).unwrap();
    assert!(why.contains("version 99") && why.contains(&format!("speaks {V}")), "{why}");
}

#[test]
fn peer_closing_mid_batch_fails_outstanding_batches() {
    use kvwire_transport::Batch;
    let src = endpoint("src");
    // A fake destination that handshakes, reads a little, then vanishes.
    let (addr, fake) = fake_destination(|mut s| {
        let mut some = vec![0u8; 1000];
        s.read_exact(&mut some).unwrap();
    });
    let mut conn = src.connect(&addr, conformance::cred()).unwrap();
    let (region, _) = conformance::source(&*src, 1 << 16, 1);
    let write = kvwire_transport::WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 1 << 16, stride: None };
    // The post may itself fail if the peer is already gone; either way nothing completes OK.
    let posted = conn.post(Batch { tag: Tag { slot: 1, layer: 0 }, writes: vec![write] });
    fake.join().unwrap();
    if posted.is_ok() {
        let c = conformance::complete(&mut *conn, 1);
        assert!(matches!(c[0].result, Err(kvwire_transport::TransportError::PeerClosed { .. })), "{:?}", c[0].result);
    }
}

/// A destination answers each write before it reads the next, as the
/// real one does once its answers fill the socket: a source that read
/// answers only after all its writes went out would stall both ends, as
/// soon as more answers wait than the two sockets hold. One batch of
/// 400,000 one-byte writes is some 16 MB of answers: every one completes.
#[test]
fn answers_are_read_while_a_large_batch_is_still_being_written() {
    use kvwire_transport::{Batch, WriteOp};
    const WRITES: usize = 400_000;
    let src = endpoint("src");
    let (addr, fake) = fake_destination(|s| {
        let mut r = std::io::BufReader::new(s.try_clone().unwrap());
        let mut w = std::io::BufWriter::with_capacity(4096, s);
        for _ in 0..WRITES {
            let mut b = [0u8; HEADER_LEN];
            r.read_exact(&mut b).unwrap();
            let h = Header::decode(&b, u64::MAX).unwrap();
            let mut payload = vec![0u8; h.len as usize];
            r.read_exact(&mut payload).unwrap();
            w.write_all(&Header { kind: Kind::Ack, offset: h.len, len: 0, ..h }.encode()).unwrap();
        }
        w.flush().unwrap();
    });
    let conn = src.connect(&addr, conformance::cred()).unwrap();
    let (region, _) = conformance::source(&*src, 64, 1);
    let write = WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 1, stride: None };
    let (result, pending) = conformance::within(conn, Duration::from_secs(60), "the batch stalled: its answers were not read while it was written", move |conn| {
        conn.post(Batch { tag: Tag { slot: 1, layer: 0 }, writes: vec![write; WRITES] }).unwrap();
        let c = conformance::complete(conn, 1);
        (c[0].result.clone(), conn.pending())
    });
    assert_eq!(result, Ok(()));
    assert_eq!(pending, 0);
    fake.join().unwrap();
}

/// A destination that stops answering and reading (it shut its sending
/// side) while a large batch waits for room: the post fails, rather than
/// waiting on a stream that has nothing more to say, while the
/// destination still holds the connection open.
#[test]
fn a_destination_that_hangs_up_its_answers_fails_a_waiting_post() {
    use kvwire_transport::{Batch, WriteOp};
    let src = endpoint("src");
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let (addr, fake) = fake_destination(move |s| {
        s.shutdown(std::net::Shutdown::Write).unwrap();
        // Open, silent, reading nothing, until the source's post returned.
        let _ = done_rx.recv_timeout(Duration::from_secs(60));
    });
    let conn = src.connect(&addr, conformance::cred()).unwrap();
    let (region, _) = conformance::source(&*src, 64 << 20, 1);
    let write = WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 64 << 20, stride: None };
    let posted = conformance::within(conn, Duration::from_secs(30), "the post still waits on a connection whose answers ended", move |conn| {
        conn.post(Batch { tag: Tag { slot: 1, layer: 0 }, writes: vec![write] }).map(|_| ())
    });
    done_tx.send(()).unwrap();
    assert!(posted.is_err(), "64 MiB were taken by a destination that reads nothing");
    fake.join().unwrap();
}

#[test]
fn an_answer_for_no_outstanding_write_closes_the_connection() {
    use kvwire_transport::{Batch, TransportError};
    let src = endpoint("src");
    // A fake destination that handshakes, then acks a write never sent.
    let (addr, fake) = fake_destination(|mut s| {
        // Wait for the write frame's header, then answer another seq.
        let mut b = [0u8; HEADER_LEN];
        s.read_exact(&mut b).unwrap();
        let write = Header::decode(&b, u64::MAX).unwrap();
        s.write_all(&Header { kind: Kind::Ack, seq: write.seq + 1000, len: 0, ..write }.encode()).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    });
    let mut conn = src.connect(&addr, conformance::cred()).unwrap();
    let (region, _) = conformance::source(&*src, 64, 1);
    let write = kvwire_transport::WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 64, stride: None };
    conn.post(Batch { tag: Tag { slot: 1, layer: 0 }, writes: vec![write] }).unwrap();
    let c = conformance::complete(&mut *conn, 1);
    assert_eq!(c[0].result, Err(TransportError::PeerClosed { pending: 1 }));
    assert!(conn.post(Batch { tag: Tag { slot: 1, layer: 1 }, writes: vec![write] }).is_err(), "closed");
    fake.join().unwrap();
}

/// Two "hosts" in network namespaces joined by a veth pair: the TCP path
/// across a real (virtual) link, not loopback. Needs root and iproute2.
#[test]
fn tcp_across_two_network_namespaces() {
    if !crate::netns::available() {
        kvwire_testkit::skip("tcp_across_two_network_namespaces", kvwire_testkit::Need::Root, "needs root and iproute2 (ip netns)");
        return;
    }
    let ns = crate::netns::Link::new("tcp").expect("create namespaces");
    let dst_ep = ns.a.run(|| endpoint_at("host-a", &format!("{}:0", ns.a.ip)));
    let dst_addr = dst_ep.local_addr();
    dst_ep.registry().open_session(conformance::cred(), "host-b").unwrap();
    let mut p = ns.b.run(|| {
        let src = endpoint_at("host-b", &format!("{}:0", ns.b.ip));
        let conn = src.connect(&dst_addr, conformance::cred()).unwrap();
        let src: Arc<dyn Endpoint> = src;
        let dst: Arc<dyn Endpoint> = dst_ep.clone();
        Pair { src, dst, conn: Some(conn) }
    });
    assert_eq!(p.conn().remote().node, "host-a");
    conformance::scatter(&mut p);
    conformance::source_released_after_local_completion(&mut p);
}

#[test]
fn a_connection_is_reusable_only_when_open_and_idle() {
    let mut p = pair();
    // Fresh and idle: reusable; a second transfer on it lands.
    assert!(p.conn().reusable());
    conformance::one_segment(&mut p);
    assert!(p.conn().reusable(), "every write answered: nothing outstanding");
    conformance::scatter(&mut p);
    assert!(p.conn().reusable());
    // With a batch outstanding it is not: its answer has not come yet.
    let dst = conformance::Window::new(&*p.dst, 3, 1 << 20);
    let (src, _) = conformance::source(&*p.src, 1 << 20, 3);
    let tag = Tag { slot: 3, layer: 0 };
    p.dst.placement().expect(tag, 1 << 20).unwrap();
    p.conn().post(kvwire_transport::Batch { tag, writes: vec![conformance::w(&src, 0, &dst.region, 0, 1 << 20)] }).unwrap();
    let outstanding = p.conn().pending() > 0;
    assert!(!outstanding || !p.conn().reusable());
    conformance::complete(p.conn(), 1);
    // A connection that was broken is not (its answer reader sees the end).
    let brk = p.conn().interrupter().expect("tcp connections can be broken from outside");
    brk();
    for _ in 0..100 {
        if !p.conn().reusable() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("a broken connection still says it is reusable");
}

/// What an outsider on the data port gets: a challenge, and nothing about
/// memory; a hello that proves no open session is refused by name, and
/// a write frame in place of a hello closes the connection. Meanwhile the
/// real source's writes land.
#[test]
fn an_unproven_connection_learns_nothing_and_places_nothing() {
    let mut p = pair();
    let dst = conformance::Window::new(&*p.dst, 1, 4096);
    let before = dst.bytes();
    let open = conformance::cred();
    type Hello<'a> = Box<dyn Fn(&[u8]) -> Vec<u8> + 'a>;
    let cases: [(&str, Hello<'_>, &str); 4] = [
        ("no session", Box::new(|nd| hello_from(nd, "src", 0, b"x")), "not open here"),
        ("wrong key", Box::new(|nd| hello_from(nd, "src", open.session, b"guess")), "did not prove"),
        ("other node", Box::new(|nd| hello_from(nd, "intruder", open.session, open.key())), "belongs to `src`"),
        ("a write first", Box::new(|_| {
            let mut v = Header { kind: Kind::Write, tag: Tag { slot: 1, layer: 0 }, key: dst.region.key, seq: 1, offset: 0, len: 4 }.encode().to_vec();
            v.extend_from_slice(b"evil");
            v
        }), "Write frame"),
    ];
    for (what, hello, why) in cases {
        let mut raw = TcpStream::connect(p.dst.local_addr()).unwrap();
        let (h, nd) = read_frame(&mut raw);
        assert_eq!((h.kind, nd.len()), (Kind::Challenge, NONCE_LEN), "{what}");
        raw.write_all(&hello(&nd)).unwrap();
        let mut rest = Vec::new();
        let _ = raw.read_to_end(&mut rest);
        let reply = Header::decode(&rest, 0).unwrap();
        assert_eq!(reply.kind, Kind::Nack, "{what}: the connection ends with the reason, not a hello");
        let text = String::from_utf8_lossy(&rest[HEADER_LEN..]);
        assert!(text.contains(why), "{what}: {text}");
        assert!(!text.contains(&format!("{}", dst.region.key)) && !text.contains("regions"), "{what}: {text}");
        assert_eq!(rest.len(), HEADER_LEN + reply.len as usize, "{what}: nothing after the refusal");
    }
    assert_eq!(dst.bytes(), before);
    conformance::one_segment(&mut p);
}

/// Before its proof a connection may send a few KiB at most, and the whole
/// handshake must end by one deadline however slowly its bytes come.
#[test]
fn an_unauthenticated_peer_can_send_little_and_hold_on_only_so_long() {
    let limits = TcpLimits { handshake_timeout: Duration::from_millis(600), ..TcpLimits::default() };
    let placement = Arc::new(Placement::new(FlagTable::new(16, 64).unwrap(), Arc::new(Hops::default())));
    let dst = TcpEndpoint::bind("dst", "127.0.0.1:0".parse().unwrap(), Arc::new(Registry::new(8)), placement, limits).unwrap();
    // A hello header claiming 5000 bytes: refused before they are read.
    let mut raw = TcpStream::connect(dst.local_addr()).unwrap();
    read_frame(&mut raw);
    raw.write_all(&frame(Kind::Hello, &[b' '; 5000])[..HEADER_LEN]).unwrap();
    let (h, why) = read_frame(&mut raw);
    assert_eq!(h.kind, Kind::Nack);
    assert!(String::from_utf8_lossy(&why).contains("5000 bytes exceeds the limit of 4096"), "{}", String::from_utf8_lossy(&why));
    // One byte every 100 ms never ends the handshake: the deadline does.
    let mut raw = TcpStream::connect(dst.local_addr()).unwrap();
    read_frame(&mut raw);
    let started = Instant::now();
    let hello = frame(Kind::Hello, &[b' '; 100]);
    let mut closed = false;
    for b in hello.iter().cycle().take(200) {
        if raw.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        let mut probe = [0u8; 1];
        raw.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        match raw.read(&mut probe) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    assert!(closed, "a trickling handshake was still open after {:?}", started.elapsed());
}

/// Connections still in their handshake are capped per listener; one
/// past the cap is closed before it gets a challenge, and a proven
/// connection is served all the while.
#[test]
fn unauthenticated_connections_are_capped() {
    let limits = TcpLimits { caps: ConnectionCaps { unauthenticated: 2, total: 4 }, ..TcpLimits::default() };
    let placement = Arc::new(Placement::new(FlagTable::new(16, 64).unwrap(), Arc::new(Hops::default())));
    let dst = TcpEndpoint::bind("dst", "127.0.0.1:0".parse().unwrap(), Arc::new(Registry::new(8)), placement, limits).unwrap();
    let mut p = Pair::new(endpoint("src"), dst.clone());
    p.conn();
    let mut idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(dst.local_addr()).unwrap()).collect();
    for s in &mut idle {
        assert_eq!(read_frame(s).0.kind, Kind::Challenge);
    }
    let mut third = TcpStream::connect(dst.local_addr()).unwrap();
    let mut got = Vec::new();
    third.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = third.read_to_end(&mut got);
    assert!(got.is_empty(), "a connection past the cap got {} bytes", got.len());
    conformance::one_segment(&mut p);
    drop(idle);
    // Their places come back.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut again = TcpStream::connect(dst.local_addr()).unwrap();
        again.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut b = [0u8; HEADER_LEN];
        if again.read_exact(&mut b).is_ok() {
            assert_eq!(Header::decode(&b, 0).unwrap().kind, Kind::Challenge);
            break;
        }
        assert!(Instant::now() < deadline, "closed connections never gave their places back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn device_memory_through_a_dmabuf_is_refused_by_a_transport_that_reads_host_mappings() {
    // tcp (as shm) reads what it sends through a host mapping, which
    // device memory does not have: a dmabuf registration names why, and
    // reserves no key.
    let ep = endpoint("src");
    let mem = kvwire_transport::HostMem::new("not-a-dmabuf", 4096).unwrap();
    let e = ep.register_dmabuf(mem.fd(), 4096, 0x1000, None).unwrap_err().to_string();
    assert!(e.contains("the tcp transport") && e.contains("GPUDirect needs verbs"), "{e}");
    assert!(ep.registry().descs().is_empty());
}

/// Strided writes: frames of whole runs, gathered at the source and
/// scattered into place (see conformance::strided_writes).
#[test]
fn strided_writes_land_run_by_run_and_count_once() {
    conformance::strided_writes(&mut pair());
}

/// A strided write whose runs exceed a frame is refused at post, naming it, nothing sent.
#[test]
fn a_strided_write_with_runs_past_a_frame_is_refused_at_post() {
    let mut p = pair();
    // Runs one byte past the default 16 MiB frame.
    let run = (16 << 20) + 1;
    let dst = conformance::Window::new(&*p.dst, 3, 2 * run);
    let (src, _) = conformance::source(&*p.src, 2 * run, 5);
    let op = WriteOp { stride: Some(kvwire_transport::Stride { count: 2, src: run, dst: run }), ..conformance::w(&src, 0, &dst.region, 0, run) };
    let err = p.conn().post(Batch { tag: conformance::tag(3, 0), writes: vec![op] }).expect_err("a run past a frame was taken");
    assert!(matches!(&err, TransportError::Unsupported(m) if m.contains("strided")), "{err}");
    assert_eq!(p.conn().framing_bytes(), 0);
}

/// Strided writes of long runs, several in one batch: the destination
/// reads each one's runs straight from the socket into place (what the
/// buffer already holds first), stopping at its last byte, so the frame
/// after it is read whole; every row lands and counts once.
#[test]
fn strided_writes_of_long_runs_back_to_back_land_exactly() {
    let mut p = pair();
    let (runs, row, writes) = (6u64, 6000u64, 3u64);
    let span = writes * runs * 2 * row;
    let dst = conformance::Window::new(&*p.dst, 5, span);
    let (src, data) = conformance::source(&*p.src, writes * runs * row, 11);
    let t = conformance::tag(5, 0);
    p.dst.placement().expect(t, writes * runs * row).unwrap();
    let before = dst.bytes();
    // Write k fills rows k, k + writes, ... of a table whose rows are 2 * row apart.
    let op = |k: u64| WriteOp {
        stride: Some(kvwire_transport::Stride { count: runs, src: row, dst: 2 * row * writes }),
        ..conformance::w(&src, k * runs * row, &dst.region, 2 * row * k, row)
    };
    p.conn().post(Batch { tag: t, writes: (0..writes).map(op).collect() }).unwrap();
    assert_eq!(conformance::complete(p.conn(), 1)[0].result, Ok(()));
    p.dst.placement().wait(t, Duration::from_secs(5)).unwrap();
    assert_eq!(p.dst.placement().placed_bytes(t), writes * runs * row);
    let mut want = before;
    for k in 0..writes {
        for r in 0..runs {
            let from = ((k * runs + r) * row) as usize;
            let to = (2 * row * k + r * 2 * row * writes) as usize;
            want[to..to + row as usize].copy_from_slice(&data[from..from + row as usize]);
        }
    }
    assert!(dst.bytes() == want, "rows landed out of place");
    dst.assert_guards();
}

/// A strided write of more runs than one gathered write carries goes as
/// several frames of whole runs; each counts once, and the rows land.
#[test]
fn a_long_strided_write_goes_as_frames_of_whole_runs() {
    let mut p = pair();
    let (runs, row) = (1200u64, 64u64);
    let dst = conformance::Window::new(&*p.dst, 4, 2 * runs * row);
    let (src, data) = conformance::source(&*p.src, runs * row, 9);
    let t = conformance::tag(4, 0);
    p.dst.placement().expect(t, runs * row).unwrap();
    let before = dst.bytes();
    let op = WriteOp { stride: Some(kvwire_transport::Stride { count: runs, src: row, dst: 2 * row }), ..conformance::w(&src, 0, &dst.region, 0, row) };
    p.conn().post(Batch { tag: t, writes: vec![op] }).unwrap();
    assert_eq!(conformance::complete(p.conn(), 1)[0].result, Ok(()));
    p.dst.placement().wait(t, Duration::from_secs(5)).unwrap();
    assert_eq!(p.dst.placement().placed_bytes(t), runs * row);
    let mut want = before;
    for r in 0..runs as usize {
        let (from, to) = (r * row as usize, 2 * r * row as usize);
        want[to..to + row as usize].copy_from_slice(&data[from..from + row as usize]);
    }
    assert!(dst.bytes() == want, "rows landed out of place");
    // More than one frame: a header and prefix each.
    assert!(p.conn().framing_bytes() >= 3 * 56, "{}", p.conn().framing_bytes());
}
