//! TCP emulation: the conformance suite on loopback, plus TCP-only cases.

use crate::conformance::{self, Pair};
use kvwire_core::protocol::{Header, Kind, Tag, HEADER_LEN, PROTOCOL_VERSION as V};
use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
use kvwire_transport::{Endpoint, FlagTable, Hops, Placement, Registry};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

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
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; HEADER_LEN];
        s.read_exact(&mut b).unwrap();
        let h = Header::decode(&b, 0).unwrap();
        let mut payload = vec![0u8; h.len as usize];
        s.read_exact(&mut payload).unwrap();
        let hello = format!(r#"{{"version":{V},"transport":"tcp","node":"fake","regions":[],"verbs":null}}"#).into_bytes();
        let h = Header { kind: Kind::Hello, tag: Tag { slot: 0, layer: 0 }, key: 0, seq: 0, offset: 0, len: hello.len() as u64 };
        s.write_all(&h.encode()).unwrap();
        s.write_all(&hello).unwrap();
        let mut some = vec![0u8; 1000];
        s.read_exact(&mut some).unwrap();
    });
    let mut conn = src.connect(&addr.to_string()).unwrap();
    let (region, _) = conformance::source(&*src, 1 << 16, 1);
    let write = kvwire_transport::WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 1 << 16 };
    // The post may itself fail if the peer is already gone; either way nothing completes OK.
    let posted = conn.post(Batch { tag: Tag { slot: 1, layer: 0 }, writes: vec![write] });
    fake.join().unwrap();
    if posted.is_ok() {
        let c = conformance::complete(&mut *conn, 1);
        assert!(matches!(c[0].result, Err(kvwire_transport::TransportError::PeerClosed { .. })), "{:?}", c[0].result);
    }
}

#[test]
fn an_answer_for_no_outstanding_write_closes_the_connection() {
    use kvwire_transport::{Batch, TransportError};
    let src = endpoint("src");
    // A fake destination that handshakes, then acks a write never sent.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; HEADER_LEN];
        s.read_exact(&mut b).unwrap();
        let mut payload = vec![0u8; Header::decode(&b, 0).unwrap().len as usize];
        s.read_exact(&mut payload).unwrap();
        let hello = format!(r#"{{"version":{V},"transport":"tcp","node":"fake","regions":[],"verbs":null}}"#).into_bytes();
        let h = Header { kind: Kind::Hello, tag: Tag { slot: 0, layer: 0 }, key: 0, seq: 0, offset: 0, len: hello.len() as u64 };
        s.write_all(&h.encode()).unwrap();
        s.write_all(&hello).unwrap();
        // Wait for the write frame's header, then answer another seq.
        s.read_exact(&mut b).unwrap();
        let write = Header::decode(&b, u64::MAX).unwrap();
        s.write_all(&Header { kind: Kind::Ack, seq: write.seq + 1000, len: 0, ..write }.encode()).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    });
    let mut conn = src.connect(&addr.to_string()).unwrap();
    let (region, _) = conformance::source(&*src, 64, 1);
    let write = kvwire_transport::WriteOp { src_key: region.key, src_offset: 0, dst_key: 42, dst_offset: 0, len: 64 };
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
        eprintln!("SKIPPED tcp_across_two_network_namespaces: needs root and iproute2 (ip netns)");
        return;
    }
    let ns = crate::netns::Link::new("tcp").expect("create namespaces");
    let dst_ep = ns.a.run(|| endpoint_at("host-a", &format!("{}:0", ns.a.ip)));
    let dst_addr = dst_ep.local_addr();
    let mut p = ns.b.run(|| {
        let src = endpoint_at("host-b", &format!("{}:0", ns.b.ip));
        let conn = src.connect(&dst_addr).unwrap();
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
    let dst = conformance::Window::new(&*p.dst, 1 << 20);
    let src = conformance::Window::new(&*p.src, 1 << 20);
    let tag = Tag { slot: 3, layer: 0 };
    p.dst.placement().expect(tag, 1 << 20).unwrap();
    p.conn().post(kvwire_transport::Batch { tag, writes: vec![conformance::w(&src.region, 0, &dst.region, 0, 1 << 20)] }).unwrap();
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
